//! Who a client is and who is exempt: `client_ip:` prefixes and `exempt:` (global or a route's).

use super::{header_pair, ip_net, Errors};
use crate::config::raw::*;
use crate::config::snapshot::*;
use crate::keys::ClientPrefix;

pub(super) fn client_prefix(e: &mut Errors, raw: &RawClientIp) -> ClientPrefix {
    let mut prefix = ClientPrefix::default();
    let mut read = |field: &str, value: Option<u32>, max: u8, out: &mut u8| match value {
        Some(v @ 1..=128) if v <= u32::from(max) => *out = v as u8,
        Some(v) => e.add(
            format!("client_ip.{field}"),
            format!("{v} is not a prefix length; expected 1-{max}"),
        ),
        None => {}
    };
    read("ipv4_prefix", raw.ipv4_prefix, 32, &mut prefix.ipv4);
    read("ipv6_prefix", raw.ipv6_prefix, 128, &mut prefix.ipv6);
    prefix
}

/// `exempt:` (global or a route's): CIDRs or single IPs, and exact header values.
pub(super) fn exempt(e: &mut Errors, path: &str, raw: &RawExempt) -> Exempt {
    let mut out = Exempt::default();
    for (i, text) in raw.client_ips.iter().enumerate() {
        out.client_ips
            .extend(e.take(format!("{path}.client_ips[{i}]"), ip_net(text)));
    }
    for (name, value) in &raw.headers {
        out.headers.extend(header_pair(
            e,
            &format!("{path}.headers.{name}"),
            name,
            value,
        ));
    }
    out
}
