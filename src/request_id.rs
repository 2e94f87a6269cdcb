//! The request id: the one name a request has in the upstream's logs, the client's response and
//! the access log (`request_id:`).
//!
//! An incoming id (`request_id.header`, default `X-Request-Id`) is kept when its sender is trusted
//! (`request_id.trust`: a `client_ip.trusted_proxies` peer by default) and it is 1 to
//! [`MAX_LEN`] visible ASCII characters, sent once; otherwise the gateway makes one
//! ([`generate`]) and it replaces whatever came. A client that is not trusted therefore cannot
//! name its requests after someone else's, nor write into the access log.
//!
//! A made id is a UUID version 7 (RFC 9562 §5.7): the Unix time in milliseconds first, so ids
//! sort by the millisecond they were made, then 74 random bits from a per-thread generator (no
//! lock, no system call). Also here: the W3C trace id a request brings in `traceparent`, which the
//! access log records.

use std::cell::Cell;
use std::hash::{BuildHasher, Hasher};
use std::time::{SystemTime, UNIX_EPOCH};

use http::{HeaderMap, HeaderValue};

use crate::config::observability::{RequestIdSettings, RequestIdTrust};

/// The longest incoming id kept; a longer one is replaced.
pub const MAX_LEN: usize = 128;

thread_local! {
    static STATE: Cell<u64> = Cell::new(seed());
}

fn seed() -> u64 {
    // `RandomState` is seeded from the operating system once per thread.
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u64(now_ms());
    hasher.finish() | 1
}

/// 64 random bits from this thread's generator (wyrand): for ids and sampling, not for secrets.
pub fn random_u64() -> u64 {
    STATE.with(|state| {
        let s = state.get().wrapping_add(0xa076_1d64_78bd_642f);
        state.set(s);
        let t = u128::from(s) * u128::from(s ^ 0xe703_7ed1_a0b4_28db);
        ((t >> 64) as u64) ^ (t as u64)
    })
}

/// A uniform fraction in `[0, 1)`.
pub fn random_fraction() -> f64 {
    (random_u64() >> 11) as f64 / (1u64 << 53) as f64
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// A fresh UUIDv7 in its 36-character text form.
pub fn generate() -> HeaderValue {
    format_v7(now_ms(), random_u64(), random_u64())
}

fn format_v7(ms: u64, a: u64, b: u64) -> HeaderValue {
    let mut bytes = [0u8; 16];
    bytes[..6].copy_from_slice(&ms.to_be_bytes()[2..]);
    bytes[6..8].copy_from_slice(&(a as u16).to_be_bytes());
    bytes[6] = 0x70 | (bytes[6] & 0x0f);
    bytes[8..].copy_from_slice(&b.to_be_bytes());
    bytes[8] = 0x80 | (bytes[8] & 0x3f);
    let value = u128::from_be_bytes(bytes);
    let mut hex = [0u8; 32];
    for (i, eight) in hex.chunks_exact_mut(8).enumerate() {
        eight.copy_from_slice(&hex8((value >> (96 - 32 * i)) as u32));
    }
    // 8-4-4-4-12 (RFC 9562 §4).
    let mut text = [b'-'; 36];
    text[..8].copy_from_slice(&hex[..8]);
    text[9..13].copy_from_slice(&hex[8..12]);
    text[14..18].copy_from_slice(&hex[12..16]);
    text[19..23].copy_from_slice(&hex[16..20]);
    text[24..].copy_from_slice(&hex[20..]);
    // Only hex digits and dashes were written. Owned as it is, in one allocation that its
    // clones (the upstream's field, the response's) share.
    HeaderValue::from_maybe_shared(bytes::Bytes::from_owner(text))
        .unwrap_or(HeaderValue::from_static("-"))
}

/// `n` as eight lower-case hex digits, most significant first, a few operations for all eight:
/// each nibble is spread into a byte of its own, then made a digit or a letter in place.
fn hex8(n: u32) -> [u8; 8] {
    let mut x = u64::from(n);
    x = (x | (x << 16)) & 0x0000_ffff_0000_ffff;
    x = (x | (x << 8)) & 0x00ff_00ff_00ff_00ff;
    x = (x | (x << 4)) & 0x0f0f_0f0f_0f0f_0f0f;
    // A byte of 10 or more gets bit 4 from adding 6; no sum reaches the next byte.
    let letters = ((x + 0x0606_0606_0606_0606) >> 4) & 0x0101_0101_0101_0101;
    (x + 0x3030_3030_3030_3030 + letters * (b'a' - b'0' - 10) as u64).to_be_bytes()
}

/// Whether `value` is kept as an incoming id: 1 to [`MAX_LEN`] visible ASCII characters other
/// than `"` and `\`.
pub fn acceptable(value: &[u8]) -> bool {
    (1..=MAX_LEN).contains(&value.len())
        && value
            .iter()
            .all(|&b| b.is_ascii_graphic() && b != b'"' && b != b'\\')
}

/// The request's id under `settings`: the incoming one when kept, else a fresh one, which then
/// replaces every incoming field of that name in `headers` (so the upstream sees the same id).
/// `None` when ids are off.
pub fn resolve(
    settings: &RequestIdSettings,
    peer_trusted: bool,
    headers: &mut HeaderMap,
) -> Option<HeaderValue> {
    if !settings.enabled {
        return None;
    }
    let trusted = match settings.trust {
        RequestIdTrust::All => true,
        RequestIdTrust::TrustedProxies => peer_trusted,
        RequestIdTrust::None => false,
    };
    if trusted {
        let mut values = headers.get_all(&settings.header).iter();
        if let (Some(value), None) = (values.next(), values.next()) {
            if acceptable(value.as_bytes()) {
                return Some(value.clone());
            }
        }
    }
    let id = generate();
    headers.insert(settings.header.clone(), id.clone());
    Some(id)
}

/// A trace id as 32 lower-case hex digits.
pub type TraceId = [u8; 32];

/// The trace id of a W3C `traceparent` (`00-TRACEID-SPANID-FLAGS`), when it is well formed and
/// not all zeros (W3C Trace Context §3.2.2.3).
pub fn trace_id(headers: &HeaderMap) -> Option<TraceId> {
    trace_id_of(headers.get("traceparent")?.as_bytes())
}

pub fn trace_id_of(value: &[u8]) -> Option<TraceId> {
    let value = value.trim_ascii();
    if value.len() < 55 || value[2] != b'-' || value[35] != b'-' || value[52] != b'-' {
        return None;
    }
    let hex = |s: &[u8]| {
        s.iter()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(b))
    };
    let (version, id, span) = (&value[..2], &value[3..35], &value[36..52]);
    if !hex(version) || version == b"ff" || !hex(id) || !hex(span) || !hex(&value[53..55]) {
        return None;
    }
    if id.iter().all(|&b| b == b'0') || span.iter().all(|&b| b == b'0') {
        return None;
    }
    let mut out = [0u8; 32];
    out.copy_from_slice(id);
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_made_id_is_a_uuid_v7_ordered_by_its_millisecond() {
        let a = format_v7(0x0190_0000_0001, u64::MAX, u64::MAX);
        let b = format_v7(0x0190_0000_0002, 0, 0);
        let (a, b) = (a.to_str().unwrap(), b.to_str().unwrap());
        assert_eq!(a, "01900000-0001-7fff-bfff-ffffffffffff");
        assert_eq!(b, "01900000-0002-7000-8000-000000000000");
        assert!(a < b);
        let fresh = generate();
        let fresh = fresh.to_str().unwrap();
        assert_eq!(fresh.len(), 36);
        assert_eq!(&fresh[14..15], "7");
        assert_ne!(fresh, generate().to_str().unwrap());
    }

    #[test]
    fn hex_digits_are_those_of_the_formatter() {
        for n in [0, 1, 9, 10, 15, 16, 0x0123_4567, 0x89ab_cdef, u32::MAX] {
            assert_eq!(hex8(n), *format!("{n:08x}").as_bytes(), "{n:#x}");
        }
        let mut n = 0x9e37_79b9u32;
        for _ in 0..10_000 {
            n = n.wrapping_mul(0x0101_0101).wrapping_add(0x7f4a_7c15);
            assert_eq!(hex8(n), *format!("{n:08x}").as_bytes(), "{n:#x}");
        }
    }

    #[test]
    fn an_incoming_id_is_kept_only_from_whom_the_settings_trust() {
        let settings = RequestIdSettings::default();
        let mut headers = HeaderMap::new();
        headers.insert("x-request-id", HeaderValue::from_static("abc-123"));
        let kept = resolve(&settings, true, &mut headers).unwrap();
        assert_eq!(kept, "abc-123");
        let replaced = resolve(&settings, false, &mut headers).unwrap();
        assert_ne!(replaced, "abc-123");
        assert_eq!(headers.get("x-request-id"), Some(&replaced));
        let all = RequestIdSettings {
            trust: RequestIdTrust::All,
            ..settings.clone()
        };
        headers.insert("x-request-id", HeaderValue::from_static("abc-123"));
        assert_eq!(resolve(&all, false, &mut headers).unwrap(), "abc-123");
        // Twice, or unprintable: replaced even from a trusted peer.
        headers.append("x-request-id", HeaderValue::from_static("other"));
        assert_ne!(resolve(&all, false, &mut headers).unwrap(), "abc-123");
        assert_eq!(headers.get_all("x-request-id").iter().count(), 1);
        headers.insert("x-request-id", HeaderValue::from_static("a \"b\""));
        assert_ne!(resolve(&all, true, &mut headers).unwrap(), "a \"b\"");
        let off = RequestIdSettings {
            enabled: false,
            ..settings
        };
        assert_eq!(resolve(&off, true, &mut headers), None);
    }

    #[test]
    fn trace_ids_come_from_well_formed_traceparents_only() {
        let good = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        assert_eq!(
            &trace_id_of(good).unwrap(),
            b"4bf92f3577b34da6a3ce929d0e0e4736"
        );
        for bad in [
            &b"00-00000000000000000000000000000000-00f067aa0ba902b7-01"[..],
            b"00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            b"ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            b"00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            b"00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            b"",
        ] {
            assert_eq!(trace_id_of(bad), None, "{}", String::from_utf8_lossy(bad));
        }
    }
}
