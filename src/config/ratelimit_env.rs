//! `turnstile ratelimit`: a policies file made from the environment variables envoyproxy/ratelimit
//! reads, so that Turnstile runs in a Deployment made for that service (Envoy Gateway's
//! `envoy-ratelimit`, or a hand-written one) without a `policies.yaml` of its own.
//!
//! Each variable that maps is written into the generated file with its name in a comment on the
//! same line, so an error the loader reports there (`FILE:LINE:COL: field`) names the variable
//! too. A variable that cannot map is an error here, naming it; one Turnstile has no use for is
//! listed in [`EnvConfig::ignored`] (the caller logs them). `docs/envoy.md` has the table.

use std::fmt::Write as _;

/// The generated policies file, and the variables that were set but do nothing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnvConfig {
    pub yaml: String,
    pub ignored: Vec<(&'static str, &'static str)>,
}

/// Variables that are set but have no effect, with why.
const IGNORED: &[(&str, &str)] = &[
    (
        "RUNTIME_IGNOREDOTFILES",
        "only *.yaml and *.yml files are read",
    ),
    (
        "RUNTIME_WATCH_ROOT",
        "the config directory is re-read on SIGHUP",
    ),
    (
        "USE_STATSD",
        "metrics are Prometheus text on the admin listener's /metrics",
    ),
    (
        "USE_PROMETHEUS",
        "metrics are Prometheus text on the admin listener's /metrics",
    ),
    (
        "PROMETHEUS_ADDR",
        "metrics are on the admin listener (HOST:PORT)",
    ),
    ("PROMETHEUS_PATH", "metrics are at /metrics"),
    ("DEBUG_HOST", "no debug listener"),
    ("DEBUG_PORT", "no debug listener"),
    ("LOG_FORMAT", "logs are text"),
    ("REDIS_SOCKET_TYPE", "TCP only (`unix` is refused)"),
    (
        "FORCE_START_WITHOUT_INITIAL_CONFIG",
        "the config directory must hold a config at start",
    ),
    ("LOCAL_CACHE_SIZE_IN_BYTES", "no local over-limit cache"),
    ("NEAR_LIMIT_RATIO", "no near-limit statistic"),
    (
        "EXPIRATION_JITTER_MAX_SECONDS",
        "counters expire with their window",
    ),
    ("GRPC_MAX_CONNECTION_AGE", "connections are not aged out"),
    (
        "GRPC_MAX_CONNECTION_AGE_GRACE",
        "connections are not aged out",
    ),
    (
        "GRPC_CLIENT_TLS_SAN",
        "every client certificate the CA signed is accepted",
    ),
];

/// The policies file for the environment `var` reads. Errors name the variable.
pub fn from_env(var: &dyn Fn(&str) -> Option<String>) -> Result<EnvConfig, String> {
    let get = |name: &str| var(name).filter(|v| !v.is_empty());
    let flag = |name: &'static str| -> Result<bool, String> {
        match get(name).as_deref().map(str::to_ascii_lowercase).as_deref() {
            None | Some("false" | "0" | "f") => Ok(false),
            Some("true" | "1" | "t") => Ok(true),
            Some(other) => Err(format!("{name}: `{other}` is not true or false")),
        }
    };
    match get("CONFIG_TYPE").as_deref() {
        None | Some("FILE") => {}
        Some("GRPC_XDS_SOTW") => {
            return Err(
                "CONFIG_TYPE: GRPC_XDS_SOTW (the config from an xDS server, Envoy \
                        Gateway's default) is not served; set CONFIG_TYPE=FILE and mount the \
                        envoyproxy/ratelimit config under \
                        RUNTIME_ROOT/RUNTIME_SUBDIRECTORY/RUNTIME_APPDIRECTORY (docs/envoy.md)"
                    .to_string(),
            )
        }
        Some(other) => return Err(format!("CONFIG_TYPE: `{other}` is not FILE")),
    }
    match get("BACKEND_TYPE").as_deref() {
        None | Some("redis") => {}
        Some(other) => return Err(format!("BACKEND_TYPE: `{other}` is not served; only redis")),
    }
    if get("GRPC_UDS").is_some() {
        return Err(
            "GRPC_UDS: a unix socket listener is not served; use GRPC_HOST and GRPC_PORT"
                .to_string(),
        );
    }
    let mut yaml = String::from(
        "# Made by `turnstile ratelimit` from envoyproxy/ratelimit's environment variables.\n\
         listen: off\n",
    );
    let address = |host: &'static str, port: &'static str, default: u16| {
        let h = get(host).unwrap_or_else(|| "0.0.0.0".to_string());
        let p = match get(port) {
            None => default,
            Some(text) => text
                .parse::<u16>()
                .map_err(|_| format!("{port}: `{text}` is not a port"))?,
        };
        let h = if h.contains(':') && !h.starts_with('[') {
            format!("[{h}]")
        } else {
            h
        };
        Ok::<_, String>(format!("{h}:{p}"))
    };
    let _ = writeln!(
        yaml,
        "admin_listen: {}  # HOST, PORT",
        quoted(&address("HOST", "PORT", 8080)?)
    );
    let root = get("RUNTIME_ROOT").unwrap_or_else(|| "/srv/runtime_data/current".to_string());
    let mut config = std::path::PathBuf::from(root);
    if let Some(sub) = get("RUNTIME_SUBDIRECTORY") {
        config.push(sub);
    }
    config.push(get("RUNTIME_APPDIRECTORY").unwrap_or_else(|| "config".to_string()));
    let _ = writeln!(
        yaml,
        "rls:\n  listen: {}  # GRPC_HOST, GRPC_PORT\n  config: {}  # RUNTIME_ROOT, \
         RUNTIME_SUBDIRECTORY, RUNTIME_APPDIRECTORY",
        quoted(&address("GRPC_HOST", "GRPC_PORT", 8081)?),
        quoted(&config.display().to_string()),
    );
    if flag("LIMIT_RESPONSE_HEADERS_ENABLED")? {
        yaml.push_str("  response_headers: true  # LIMIT_RESPONSE_HEADERS_ENABLED\n");
    }
    if flag("RESPONSE_DYNAMIC_METADATA")? {
        yaml.push_str("  response_dynamic_metadata: true  # RESPONSE_DYNAMIC_METADATA\n");
    }
    if flag("GRPC_SERVER_USE_TLS")? {
        let need = |name: &'static str| {
            get(name).ok_or_else(|| format!("{name}: needed with GRPC_SERVER_USE_TLS=true"))
        };
        let _ = writeln!(
            yaml,
            "  tls:  # GRPC_SERVER_USE_TLS\n    cert: {}  # GRPC_SERVER_TLS_CERT\n    key: {}  \
             # GRPC_SERVER_TLS_KEY",
            quoted(&need("GRPC_SERVER_TLS_CERT")?),
            quoted(&need("GRPC_SERVER_TLS_KEY")?),
        );
        // envoyproxy/ratelimit's name, and the one Envoy Gateway sets.
        let ca = [("GRPC_CLIENT_TLS_CACERT"), ("GRPC_SERVER_TLS_CA_CERT")]
            .into_iter()
            .find_map(|name| get(name).map(|v| (name, v)));
        if let Some((name, ca)) = ca {
            let _ = writeln!(yaml, "    client_ca: {}  # {name}", quoted(&ca));
        }
    }
    store(&get, &mut yaml)?;
    let ignored = IGNORED
        .iter()
        .filter(|(name, _)| get(name).is_some())
        .copied()
        .collect();
    Ok(EnvConfig { yaml, ignored })
}

/// `store:` from `REDIS_*`: the in-process store when `REDIS_URL` is not set.
fn store(get: &dyn Fn(&str) -> Option<String>, yaml: &mut String) -> Result<(), String> {
    let Some(url) = get("REDIS_URL") else {
        yaml.push_str("store:\n  type: memory  # no REDIS_URL\n");
        return Ok(());
    };
    if get("REDIS_SOCKET_TYPE").is_some_and(|t| t == "unix") {
        return Err("REDIS_SOCKET_TYPE: unix sockets are not served; use tcp".to_string());
    }
    let tls = get("REDIS_TLS").is_some_and(|v| v.eq_ignore_ascii_case("true") || v == "1");
    let auth = get("REDIS_AUTH");
    yaml.push_str("store:\n  type: redis  # REDIS_URL\n");
    match get("REDIS_TYPE").map(|t| t.to_ascii_uppercase()).as_deref() {
        None | Some("SINGLE") => {
            let scheme = if tls { "rediss" } else { "redis" };
            // REDIS_AUTH is `password` or `user:password`.
            let credentials = auth
                .as_deref()
                .map(|a| {
                    if a.contains(':') {
                        format!("{a}@")
                    } else {
                        format!(":{a}@")
                    }
                })
                .unwrap_or_default();
            let _ = writeln!(
                yaml,
                "  url: {}  # REDIS_URL, REDIS_TLS, REDIS_AUTH",
                quoted(&format!("{scheme}://{credentials}{url}"))
            );
        }
        Some("CLUSTER") => {
            if tls {
                return Err("REDIS_TLS: not served with REDIS_TYPE=CLUSTER".to_string());
            }
            let nodes: Vec<String> = url.split(',').map(|n| quoted(n.trim())).collect();
            let _ = writeln!(
                yaml,
                "  cluster: [{}]  # REDIS_TYPE, REDIS_URL",
                nodes.join(", ")
            );
            if let Some(auth) = auth {
                let (user, password) = auth.split_once(':').unwrap_or(("", &auth));
                if !user.is_empty() {
                    let _ = writeln!(yaml, "  username: {}  # REDIS_AUTH", quoted(user));
                }
                let _ = writeln!(yaml, "  password: {}  # REDIS_AUTH", quoted(password));
            }
        }
        Some("SENTINEL") => {
            if tls {
                return Err("REDIS_TLS: not served with REDIS_TYPE=SENTINEL".to_string());
            }
            // envoyproxy/ratelimit's form: `MASTER_NAME,SENTINEL1,SENTINEL2,...`.
            let mut parts = url.split(',').map(str::trim);
            let service = parts.next().unwrap_or_default();
            let nodes: Vec<String> = parts.map(quoted).collect();
            if service.is_empty() || nodes.is_empty() {
                return Err(format!(
                    "REDIS_URL: `{url}` is not MASTER_NAME,HOST:PORT,... for REDIS_TYPE=SENTINEL"
                ));
            }
            let _ = writeln!(
                yaml,
                "  sentinel: {{service: {}, nodes: [{}]}}  # REDIS_TYPE, REDIS_URL",
                quoted(service),
                nodes.join(", ")
            );
            if let Some(auth) = auth {
                let (user, password) = auth.split_once(':').unwrap_or(("", &auth));
                if !user.is_empty() {
                    let _ = writeln!(yaml, "  username: {}  # REDIS_AUTH", quoted(user));
                }
                let _ = writeln!(yaml, "  password: {}  # REDIS_AUTH", quoted(password));
            }
        }
        Some(other) => {
            return Err(format!(
                "REDIS_TYPE: `{other}` is not served; use SINGLE, CLUSTER or SENTINEL"
            ))
        }
    }
    if let Some(size) = get("REDIS_POOL_SIZE") {
        let size: u32 = size
            .parse()
            .map_err(|_| format!("REDIS_POOL_SIZE: `{size}` is not a number"))?;
        let _ = writeln!(yaml, "  pool_size: {size}  # REDIS_POOL_SIZE");
    }
    if let Some(prefix) = get("CACHE_KEY_PREFIX") {
        let _ = writeln!(
            yaml,
            "  key_prefix: {}  # CACHE_KEY_PREFIX",
            quoted(&prefix)
        );
    }
    Ok(())
}

/// A YAML double-quoted scalar.
fn quoted(text: &str) -> String {
    serde_json::to_string(text).unwrap_or_else(|_| "\"\"".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(vars: &[(&str, &str)]) -> Result<EnvConfig, String> {
        let vars: Vec<(String, String)> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        from_env(&move |name| vars.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone()))
    }

    /// What Envoy Gateway sets on its `envoy-ratelimit` Deployment, with CONFIG_TYPE=FILE.
    #[test]
    fn envoy_gateways_variables_map_to_tls_with_a_client_ca_and_redis() {
        let made = env(&[
            ("REDIS_SOCKET_TYPE", "tcp"),
            ("REDIS_URL", "redis.redis.svc:6379"),
            ("RUNTIME_ROOT", "/data"),
            ("RUNTIME_SUBDIRECTORY", "ratelimit"),
            ("RUNTIME_IGNOREDOTFILES", "true"),
            ("RUNTIME_WATCH_ROOT", "false"),
            ("LOG_LEVEL", "info"),
            ("USE_STATSD", "false"),
            ("CONFIG_TYPE", "FILE"),
            ("GRPC_SERVER_USE_TLS", "true"),
            ("GRPC_SERVER_TLS_CERT", "/certs/tls.crt"),
            ("GRPC_SERVER_TLS_KEY", "/certs/tls.key"),
            ("GRPC_SERVER_TLS_CA_CERT", "/certs/ca.crt"),
        ])
        .expect("maps");
        assert!(made.yaml.contains("listen: off\n"), "{}", made.yaml);
        assert!(made.yaml.contains("admin_listen: \"0.0.0.0:8080\""));
        assert!(made.yaml.contains("  listen: \"0.0.0.0:8081\""));
        assert!(made.yaml.contains("  config: \"/data/ratelimit/config\""));
        assert!(made
            .yaml
            .contains("    client_ca: \"/certs/ca.crt\"  # GRPC_SERVER_TLS_CA_CERT"));
        assert!(made
            .yaml
            .contains("  url: \"redis://redis.redis.svc:6379\""));
        let ignored: Vec<&str> = made.ignored.iter().map(|(n, _)| *n).collect();
        assert_eq!(
            ignored,
            [
                "RUNTIME_IGNOREDOTFILES",
                "RUNTIME_WATCH_ROOT",
                "USE_STATSD",
                "REDIS_SOCKET_TYPE"
            ]
        );
    }

    #[test]
    fn redis_sentinel_and_cluster_urls_map_to_their_store_blocks() {
        let sentinel = env(&[
            ("REDIS_TYPE", "sentinel"),
            ("REDIS_URL", "mymaster,10.0.0.1:26379,10.0.0.2:26379"),
        ])
        .expect("maps");
        assert!(sentinel.yaml.contains(
            "  sentinel: {service: \"mymaster\", nodes: [\"10.0.0.1:26379\", \"10.0.0.2:26379\"]}"
        ), "{}", sentinel.yaml);
        let cluster =
            env(&[("REDIS_TYPE", "CLUSTER"), ("REDIS_URL", "a:6379, b:6379")]).expect("maps");
        assert!(
            cluster.yaml.contains("  cluster: [\"a:6379\", \"b:6379\"]"),
            "{}",
            cluster.yaml
        );
        for made in [sentinel, cluster] {
            crate::config::parse(&made.yaml, std::path::Path::new("p.yaml"))
                .map(|_| ())
                .or_else(|e| {
                    // Only the config directory is missing here.
                    let text = e.to_string();
                    if text.lines().all(|l| l.contains("rls.config")) {
                        Ok(())
                    } else {
                        Err(text)
                    }
                })
                .expect("the store block loads");
        }
    }

    #[test]
    fn the_xds_config_source_is_refused_by_name() {
        let e = env(&[("CONFIG_TYPE", "GRPC_XDS_SOTW")]).expect_err("refused");
        assert!(e.starts_with("CONFIG_TYPE: GRPC_XDS_SOTW"), "{e}");
    }

    #[test]
    fn tls_without_its_files_names_the_missing_variable() {
        let e = env(&[
            ("GRPC_SERVER_USE_TLS", "true"),
            ("GRPC_SERVER_TLS_KEY", "/k"),
        ])
        .expect_err("refused");
        assert!(e.starts_with("GRPC_SERVER_TLS_CERT:"), "{e}");
        let e = env(&[("GRPC_PORT", "eighty")]).expect_err("refused");
        assert_eq!(e, "GRPC_PORT: `eighty` is not a port");
    }

    #[test]
    fn the_generated_file_loads() {
        let dir = tempfile::tempdir().expect("tempdir");
        let config = dir.path().join("ratelimit/config");
        std::fs::create_dir_all(&config).expect("mkdir");
        std::fs::write(
            config.join("a.yaml"),
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1}\n",
        )
        .expect("write");
        let root = dir.path().display().to_string();
        let made = env(&[
            ("RUNTIME_ROOT", &root),
            ("RUNTIME_SUBDIRECTORY", "ratelimit"),
        ])
        .expect("maps");
        let path = dir.path().join("policies.yaml");
        let snapshot = crate::config::parse(&made.yaml, &path).expect("loads");
        assert_eq!(snapshot.listen, None);
        assert!(snapshot.rls.is_some());
    }
}
