//! Compiling the TLS settings: `listen_tls:`, every listener's `tls:` block, and an upstream's `ca`, `client_cert` and
//! `tls_verify`. The files are read here, at load, so that `turnstile check` and a reload report
//! a missing or bad file with its field (`listen_tls.cert`) and path, and nothing is read on a
//! request path.

use std::path::Path;
use std::time::Duration;

use super::raw::{RawListenTls, RawServerTls, RawUpstream};
use crate::tls::server::Material;
use crate::tls::{client, files, ClientAuth, ListenerTls, ServerTlsSettings, UpstreamTls};

/// A problem (or warning) at a field path.
pub type Problem = (String, String);

/// Like NGINX's `ssl_handshake_timeout` default (60 s there): long enough for a slow mobile
/// client, short enough that silent connections do not hold slots.
pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
pub const DEFAULT_LISTEN_TLS: &str = "0.0.0.0:8443";

/// `listen_tls:` with its address and handshake timeout already parsed by the caller.
pub fn listener(
    raw: &RawListenTls,
    source: &Path,
    listen: std::net::SocketAddr,
) -> Result<ListenerTls, Vec<Problem>> {
    let tls = server(&raw.tls(), "listen_tls", source)?;
    Ok(ListenerTls { listen, tls })
}

/// A listener's TLS (`listen_tls`, `rls.tls`, `forward_auth.tls`, `admin.tls`, named by
/// `field`): the certificate and key read and matched, the client CA read and usable, so that a
/// listener never starts with TLS it cannot serve.
pub fn server(
    raw: &RawServerTls,
    field: &str,
    source: &Path,
) -> Result<ServerTlsSettings, Vec<Problem>> {
    let cert = files::resolve(source, &raw.cert);
    let key = files::resolve(source, &raw.key);
    let mut problems = Vec::new();
    if let Err(e) = files::certificates(&cert) {
        problems.push((format!("{field}.cert"), e));
    }
    if let Err(e) = files::private_key(&key) {
        problems.push((format!("{field}.key"), e));
    }
    let handshake_timeout = match raw.handshake_timeout.as_deref() {
        None => DEFAULT_HANDSHAKE_TIMEOUT,
        Some(text) => match crate::units::parse_duration(text) {
            Ok(d) if !d.is_zero() => d,
            Ok(_) => {
                problems.push((
                    format!("{field}.handshake_timeout"),
                    "must be more than 0".to_string(),
                ));
                DEFAULT_HANDSHAKE_TIMEOUT
            }
            Err(e) => {
                problems.push((format!("{field}.handshake_timeout"), e));
                DEFAULT_HANDSHAKE_TIMEOUT
            }
        },
    };
    let client_auth = match (raw.client_auth.as_deref(), raw.client_ca.is_some()) {
        (None, _) => Some(ClientAuth::Required),
        (Some("required"), true) => Some(ClientAuth::Required),
        (Some("optional"), true) => Some(ClientAuth::Optional),
        (Some("required" | "optional"), false) => {
            problems.push((
                format!("{field}.client_auth"),
                "needs `client_ca:`, the CA client certificates are verified against".to_string(),
            ));
            None
        }
        (Some(other), _) => {
            problems.push((
                format!("{field}.client_auth"),
                format!("`{other}` is not a client auth mode; expected `required` or `optional`"),
            ));
            None
        }
    };
    let client_ca = raw.client_ca.as_deref().map(|c| files::resolve(source, c));
    if let Some(ca) = &client_ca {
        if let Err(e) = files::certificates(ca) {
            problems.push((format!("{field}.client_ca"), e));
        }
    }
    if !problems.is_empty() {
        return Err(problems);
    }
    let loaded = Material::read(&cert, &key, client_ca.as_deref())
        .map_err(|e| vec![(field.to_string(), e)])?;
    let client_ca = client_ca.zip(client_auth);
    crate::tls::server::check(&loaded, client_ca.as_ref().map(|(_, auth)| *auth))
        .map_err(|e| vec![(format!("{field}.client_ca"), e)])?;
    Ok(ServerTlsSettings {
        cert,
        key,
        client_ca,
        handshake_timeout,
        loaded: std::sync::Arc::new(loaded),
    })
}

/// The TLS client settings of upstream `path` (`upstreams.NAME`): `Ok(None)` for an `http://`
/// one, which must not set any of them. The second list holds warnings (`tls_verify: false`).
pub fn upstream(
    path: &str,
    raw: &RawUpstream,
    https: bool,
    source: &Path,
) -> Result<(Option<UpstreamTls>, Vec<Problem>), Vec<Problem>> {
    if !https {
        let set: Vec<Problem> = [
            ("ca", raw.ca.is_some()),
            ("client_cert", raw.client_cert.is_some()),
            ("tls_verify", raw.tls_verify.is_some()),
        ]
        .into_iter()
        .filter(|(_, set)| *set)
        .map(|(field, _)| {
            (
                format!("{path}.{field}"),
                "applies to https:// upstreams only; this one is http://".to_string(),
            )
        })
        .collect();
        return if set.is_empty() {
            Ok((None, Vec::new()))
        } else {
            Err(set)
        };
    }
    let verify = raw.tls_verify.unwrap_or(true);
    let mut warnings = Vec::new();
    if !verify {
        if raw.ca.is_some() {
            return Err(vec![(
                format!("{path}.ca"),
                "has no effect with `tls_verify: false`; remove one of them".to_string(),
            )]);
        }
        warnings.push((
            format!("{path}.tls_verify"),
            "is false: the upstream's certificate is not verified, so anyone on the path can \
             impersonate it; use `ca:` for a private CA instead"
                .to_string(),
        ));
    }
    let ca = raw.ca.as_deref().map(|c| files::resolve(source, c));
    let client_cert = raw.client_cert.as_ref().map(|c| {
        (
            files::resolve(source, &c.cert),
            files::resolve(source, &c.key),
        )
    });
    let options = client::Options {
        ca: ca.as_deref(),
        client_cert: client_cert
            .as_ref()
            .map(|(c, k)| (c.as_path(), k.as_path())),
        verify,
    };
    match UpstreamTls::new(options) {
        Ok(tls) => Ok((Some(tls), warnings)),
        Err((field, message)) => Err(vec![(format!("{path}.{field}"), message)]),
    }
}
