//! The YAML vocabulary of `policies.yaml`, as written by users. Nothing here is validated beyond
//! its shape; [`super::compile`] turns it into the runtime snapshot. Every struct denies unknown
//! fields: a misspelt option is an error, never silently ignored.

use std::collections::BTreeMap;

use serde::Deserialize;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    pub listen: Option<String>,
    pub admin_listen: Option<String>,
    #[serde(default)]
    pub client_ip: RawClientIp,
    #[serde(default)]
    pub store: RawStore,
    #[serde(default)]
    pub server: RawServer,
    #[serde(default)]
    pub upstreams: BTreeMap<String, RawUpstream>,
    #[serde(default)]
    pub routes: Vec<RawRoute>,
    /// The Envoy rate limit service (`crate::rls`).
    pub rls: Option<crate::rls::RawRls>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawClientIp {
    #[serde(default)]
    pub trusted_proxies: Vec<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawStore {
    #[serde(rename = "type")]
    pub kind: Option<String>,
    /// memory: the most counters kept at once.
    pub max_keys: Option<u64>,
    /// redis: one server...
    pub url: Option<String>,
    /// ...or Redis Cluster seed nodes (`host:port`)...
    pub cluster: Option<Vec<String>>,
    /// ...or the master Sentinel names.
    pub sentinel: Option<RawSentinel>,
    /// Credentials of the data nodes, for `cluster` and `sentinel` (a `url` carries its own).
    pub username: Option<String>,
    pub password: Option<String>,
    pub pool_size: Option<u32>,
    pub timeout: Option<String>,
    pub failure_mode: Option<String>,
    pub key_prefix: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawSentinel {
    /// The master's name in Sentinel (`sentinel monitor NAME ...`).
    pub service: String,
    /// Sentinel addresses, `host:port`.
    pub nodes: Vec<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawServer {
    pub max_body_size: Option<String>,
    pub header_read_timeout: Option<String>,
    pub shutdown_grace: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawUpstream {
    pub url: String,
    pub connect_timeout: Option<String>,
    pub timeout: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRoute {
    pub name: String,
    #[serde(rename = "match", default)]
    pub matcher: RawMatch,
    pub upstream: Option<String>,
    pub respond: Option<RawRespond>,
    #[serde(default)]
    pub policies: Vec<RawPolicy>,
    pub failure_mode: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawMatch {
    pub path: Option<String>,
    pub prefix: Option<String>,
    pub methods: Option<Vec<String>>,
    pub host: Option<String>,
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRespond {
    #[serde(default = "default_status")]
    pub status: u16,
    #[serde(default)]
    pub body: String,
    pub content_type: Option<String>,
}

fn default_status() -> u16 {
    200
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawPolicy {
    pub name: String,
    pub key: Vec<String>,
    pub token_bucket: Option<RawTokenBucket>,
    pub sliding_window: Option<RawSlidingWindow>,
    pub cost: Option<u64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawTokenBucket {
    pub rate: String,
    pub burst: u64,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawSlidingWindow {
    pub limit: u64,
    pub window: String,
    pub buckets: Option<u32>,
}
