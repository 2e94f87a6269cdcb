//! Which Redis deployment the store talks to: one server, a Redis Cluster, or the master that
//! Sentinel names. Validated at config load ([`Target::check`]) so a bad address is a config error
//! with its line, never a store that silently never connects.

use fred::prelude::{Config, ServerConfig};
use fred::types::config::ClusterDiscoveryPolicy;

/// The deployment named by `store.url`, `store.cluster` or `store.sentinel`.
#[derive(Clone, PartialEq, Eq)]
pub enum Target {
    /// One server (`redis://` or `rediss://`, credentials and database in the URL).
    Url(String),
    /// Redis Cluster: seed nodes; the rest of the topology is discovered (`CLUSTER SLOTS`) and
    /// refreshed on `MOVED` and on reconnection.
    Cluster { nodes: Vec<String>, auth: Auth },
    /// The master that the Sentinels at `nodes` name for `service`, asked again on every
    /// reconnection, so a failover is followed without a restart.
    Sentinel {
        service: String,
        nodes: Vec<String>,
        auth: Auth,
    },
}

/// Credentials of the data nodes (also sent to Sentinels), for targets without a URL.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Auth {
    pub username: Option<String>,
    pub password: Option<String>,
}

/// Never prints a password (URLs may carry one too).
impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::Url(_) => f.write_str("Url(..)"),
            Target::Cluster { nodes, .. } => {
                f.debug_struct("Cluster").field("nodes", nodes).finish()
            }
            Target::Sentinel { service, nodes, .. } => f
                .debug_struct("Sentinel")
                .field("service", service)
                .field("nodes", nodes)
                .finish(),
        }
    }
}

impl std::fmt::Debug for Auth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Auth")
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| ".."))
            .finish()
    }
}

/// `host:port` (`[v6]:port` for IPv6), as written in `store.cluster` and `store.sentinel.nodes`.
pub fn parse_node(node: &str) -> Result<(String, u16), String> {
    let (host, port) = node
        .rsplit_once(':')
        .ok_or_else(|| format!("`{node}` is not host:port"))?;
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    if host.is_empty() || host.contains(['/', ' ', '@']) {
        return Err(format!("`{node}` is not host:port"));
    }
    let port: u16 = port
        .parse()
        .ok()
        .filter(|p| *p > 0)
        .ok_or_else(|| format!("`{node}` has no valid port (1-65535)"))?;
    Ok((host.to_string(), port))
}

impl Target {
    /// Whether requests are spread over Cluster slots (see `cluster.rs`).
    pub fn is_cluster(&self) -> bool {
        matches!(self, Target::Cluster { .. })
    }

    /// fred's client config for this target. Errors never repeat the URL.
    pub fn config(&self) -> Result<Config, String> {
        let nodes = |nodes: &[String]| -> Result<Vec<(String, u16)>, String> {
            if nodes.is_empty() {
                return Err("needs at least one host:port".to_string());
            }
            nodes.iter().map(|n| parse_node(n)).collect()
        };
        let with_auth = |server: ServerConfig, auth: &Auth| Config {
            server,
            username: auth.username.clone(),
            password: auth.password.clone(),
            ..Config::default()
        };
        match self {
            Target::Url(url) => {
                if !(url.starts_with("redis://") || url.starts_with("rediss://")) {
                    return Err("must start with redis:// or rediss://".to_string());
                }
                Config::from_url(url)
                    .map_err(|e| format!("is not a valid Redis URL: {}", e.details()))
            }
            Target::Cluster { nodes: seeds, auth } => Ok(with_auth(
                ServerConfig::Clustered {
                    hosts: nodes(seeds)?
                        .into_iter()
                        .map(|(host, port)| fred::types::config::Server::new(host, port))
                        .collect(),
                    // Seeds, then every node of the last known topology: a killed seed must not
                    // keep the gateway from finding the promoted replica.
                    policy: ClusterDiscoveryPolicy::UseCache,
                },
                auth,
            )),
            Target::Sentinel {
                service,
                nodes: sentinels,
                auth,
            } => {
                if service.is_empty() {
                    return Err("sentinel.service must not be empty".to_string());
                }
                Ok(with_auth(
                    ServerConfig::new_sentinel(nodes(sentinels)?, service.as_str()),
                    auth,
                ))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nodes_are_host_and_port() {
        assert_eq!(
            parse_node("10.0.0.1:6379").unwrap(),
            ("10.0.0.1".into(), 6379)
        );
        assert_eq!(parse_node("[::1]:7000").unwrap(), ("::1".into(), 7000));
        assert!(parse_node("redis.local").is_err());
        assert!(parse_node("redis.local:0").is_err());
        assert!(parse_node("redis://a:1").is_err());
        assert!(parse_node(":6379").is_err());
    }

    #[test]
    fn debug_never_shows_a_password() {
        let t = Target::Url("redis://:secret@127.0.0.1".into());
        assert!(!format!("{t:?}").contains("secret"));
        let t = Target::Cluster {
            nodes: vec!["a:1".into()],
            auth: Auth {
                username: None,
                password: Some("secret".into()),
            },
        };
        assert!(!format!("{t:?}").contains("secret"));
        assert!(t.config().is_ok());
    }
}
