//! The listeners besides `listen` and `admin_listen`: `listen_tls:`, `forward_auth:` and
//! `ext_proc:`.

use std::net::SocketAddr;
use std::path::Path;

use http::StatusCode;

use super::{socket_addr, Errors};
use crate::config::raw::*;
use crate::config::snapshot::*;

/// `listen_tls:`: its own address (not one of the other listeners') and readable, matching
/// certificate and key files.
pub(super) fn listen_tls(
    e: &mut Errors,
    raw: &RawListenTls,
    source: &Path,
    others: [Option<SocketAddr>; 2],
) -> Option<crate::tls::ListenerTls> {
    let text = raw
        .listen
        .as_deref()
        .unwrap_or(crate::config::tls::DEFAULT_LISTEN_TLS);
    let listen = socket_addr(e, "listen_tls.listen", text)?;
    if listen.port() != 0 && others.contains(&Some(listen)) {
        e.add(
            "listen_tls.listen",
            "must differ from `listen` and `admin_listen`",
        );
    }
    crate::config::tls::listener(raw, source, listen)
        .map_err(|problems| problems.into_iter().for_each(|(p, m)| e.add(p, m)))
        .ok()
}

/// A listener's `tls:` block at `field`, when it has one.
pub(super) fn server_tls(
    e: &mut Errors,
    raw: Option<&RawServerTls>,
    field: &str,
    source: &Path,
) -> Option<crate::tls::ServerTlsSettings> {
    crate::config::tls::server(raw?, field, source)
        .map_err(|problems| problems.into_iter().for_each(|(p, m)| e.add(p, m)))
        .ok()
}

pub(super) fn forward_auth(
    e: &mut Errors,
    raw: &RawForwardAuth,
    listen: Option<SocketAddr>,
    admin_listen: Option<SocketAddr>,
    source: &Path,
) -> Option<ForwardAuthSettings> {
    let tls = server_tls(e, raw.tls.as_ref(), "forward_auth.tls", source);
    if raw.tls.is_some() && tls.is_none() {
        return None;
    }
    let http = raw
        .listen
        .as_deref()
        .map(|t| socket_addr(e, "forward_auth.listen", t));
    let grpc = raw
        .grpc_listen
        .as_deref()
        .map(|t| socket_addr(e, "forward_auth.grpc_listen", t));
    if http.is_none() && grpc.is_none() {
        e.add(
            "forward_auth",
            "needs `listen: IP:PORT` (the HTTP /check endpoint), `grpc_listen: IP:PORT` (Envoy \
             ext_authz), or both",
        );
    }
    let taken = [("listen", listen), ("admin_listen", admin_listen)];
    for (field, addr) in [("listen", http.flatten()), ("grpc_listen", grpc.flatten())] {
        let Some(addr) = addr.filter(|a| a.port() != 0) else {
            continue;
        };
        if let Some((other, _)) = taken.iter().find(|(_, a)| *a == Some(addr)) {
            e.add(
                format!("forward_auth.{field}"),
                format!("`{addr}` is already `{other}`: every door has its own listener"),
            );
        }
    }
    if let (Some(Some(a)), Some(Some(b))) = (http, grpc) {
        if a == b && a.port() != 0 {
            e.add(
                "forward_auth.grpc_listen",
                "must differ from `forward_auth.listen`",
            );
        }
    }
    let deny_status = match raw.deny_status {
        None => Some(http::StatusCode::TOO_MANY_REQUESTS),
        Some(code) => e.take("forward_auth.deny_status", deny_status(code)),
    };
    let proxy = match raw.proxy.as_deref() {
        None => Some(CheckProxy::Auto),
        Some(text) => CheckProxy::parse(text).or_else(|| {
            e.add(
                "forward_auth.proxy",
                format!(
                    "`{text}` is not a proxy Turnstile knows: use {}",
                    CheckProxy::NAMES
                ),
            );
            None
        }),
    };
    Some(ForwardAuthSettings {
        listen: http.flatten(),
        grpc_listen: grpc.flatten(),
        deny_status: deny_status?,
        proxy: proxy?,
        tls,
    })
}

/// `ext_proc.listen`: an address of its own.
pub(super) fn ext_proc(
    e: &mut Errors,
    raw: &RawExtProc,
    others: [(&str, Option<SocketAddr>); 2],
) -> Option<SocketAddr> {
    let addr = socket_addr(e, "ext_proc.listen", &raw.listen)?;
    if let Some((other, _)) = others
        .iter()
        .find(|(_, a)| addr.port() != 0 && *a == Some(addr))
    {
        e.add(
            "ext_proc.listen",
            format!("`{addr}` is already `{other}`: every door has its own listener"),
        );
    }
    Some(addr)
}

/// A refusal's status: a 4xx or 5xx (nginx's `auth_request` passes on only 401 and 403).
pub fn deny_status(code: u16) -> Result<StatusCode, String> {
    StatusCode::from_u16(code)
        .ok()
        .filter(|s| s.is_client_error() || s.is_server_error())
        .ok_or_else(|| format!("`{code}` is not a 4xx or 5xx status (e.g. 429, or 403 for nginx)"))
}
