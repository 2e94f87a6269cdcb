//! [`Ask::read`] against prost's decoding of the same bytes: the same fields when prost decodes
//! them, a failure when prost fails.

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::{
    Entry as PbEntry, RateLimitOverride,
};
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use envoy_types::pb::google::protobuf::UInt64Value;
use proptest::prelude::*;
use prost::Message;

use super::Ask;

/// Both readers on `bytes`: prost decodes them iff `Ask::read` does, to the same fields.
fn agree(bytes: &[u8]) -> Result<(), TestCaseError> {
    let decoded = RateLimitRequest::decode(bytes);
    match (&decoded, Ask::read(bytes)) {
        (Ok(request), Some(ask)) => prop_assert_eq!(Ask::of(request), ask),
        (Err(_), None) => {}
        (prost, ours) => prop_assert!(false, "prost {prost:?}, read {ours:?}, bytes {bytes:?}"),
    }
    Ok(())
}

fn text() -> impl Strategy<Value = String> {
    prop_oneof!["[a-z_]{0,6}", any::<String>(), Just("é/ü ✓".to_owned())]
}

fn pb_request() -> impl Strategy<Value = RateLimitRequest> {
    let entry = (text(), text()).prop_map(|(key, value)| PbEntry { key, value });
    let limit =
        (any::<u32>(), prop_oneof![0..6i32, any::<i32>()]).prop_map(|(requests_per_unit, unit)| {
            RateLimitOverride {
                requests_per_unit,
                unit,
            }
        });
    let descriptor = (
        prop::collection::vec(entry, 0..4),
        prop::option::of(limit),
        prop::option::of(any::<u64>().prop_map(|value| UInt64Value { value })),
        any::<bool>(),
    )
        .prop_map(
            |(entries, limit, hits_addend, is_negative_hits)| RateLimitDescriptor {
                entries,
                limit,
                hits_addend,
                is_negative_hits,
            },
        );
    (
        text(),
        prop::collection::vec(descriptor, 0..4),
        prop_oneof![Just(0u32), any::<u32>()],
    )
        .prop_map(|(domain, descriptors, hits_addend)| RateLimitRequest {
            domain,
            descriptors,
            hits_addend,
        })
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn put_key(out: &mut Vec<u8>, tag: u32, wire: u8) {
    put_varint(out, (u64::from(tag) << 3) | u64::from(wire));
}

fn put_len(out: &mut Vec<u8>, tag: u32, bytes: &[u8]) {
    put_key(out, tag, 2);
    put_varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// One field any message may carry and none of ours reads: an unknown tag of any wire type,
/// groups (nested) included.
fn unknown(depth: u32) -> BoxedStrategy<Vec<u8>> {
    let tag = prop_oneof![5u32..20, Just(536_870_911u32), 1000u32..2000];
    let leaf = (
        tag.clone(),
        0u8..6,
        any::<u64>(),
        prop::collection::vec(any::<u8>(), 0..8),
    )
        .prop_map(|(tag, wire, n, bytes)| {
            let mut out = Vec::new();
            match wire {
                0 => {
                    put_key(&mut out, tag, 0);
                    put_varint(&mut out, n);
                }
                1 => {
                    put_key(&mut out, tag, 1);
                    out.extend_from_slice(&n.to_le_bytes());
                }
                5 => {
                    put_key(&mut out, tag, 5);
                    out.extend_from_slice(&(n as u32).to_le_bytes());
                }
                3 => {
                    // An empty group.
                    put_key(&mut out, tag, 3);
                    put_key(&mut out, tag, 4);
                }
                _ => put_len(&mut out, tag, &bytes),
            }
            out
        });
    if depth == 0 {
        return leaf.boxed();
    }
    let group = (tag, prop::collection::vec(unknown(depth - 1), 0..3)).prop_map(|(tag, fields)| {
        let mut out = Vec::new();
        put_key(&mut out, tag, 3);
        out.extend(fields.concat());
        put_key(&mut out, tag, 4);
        out
    });
    prop_oneof![3 => leaf, 1 => group].boxed()
}

/// A known tag with any wire type (mostly the wrong one for it).
fn mistyped(max_tag: u32) -> impl Strategy<Value = Vec<u8>> {
    (1..=max_tag, 0u8..6, any::<u8>()).prop_map(|(tag, wire, n)| {
        let mut out = Vec::new();
        put_key(&mut out, tag, wire);
        match wire {
            0 => put_varint(&mut out, u64::from(n)),
            1 => out.extend_from_slice(&[n; 8]),
            2 => put_varint(&mut out, 0),
            3 => put_key(&mut out, tag, 4),
            5 => out.extend_from_slice(&[n; 4]),
            _ => {}
        }
        out
    })
}

fn text_bytes() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        4 => text().prop_map(String::into_bytes),
        1 => prop::collection::vec(any::<u8>(), 0..6),
    ]
}

fn varint_field(tag: u32) -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![any::<u64>(), 0u64..300].prop_map(move |n| {
        let mut out = Vec::new();
        put_key(&mut out, tag, 0);
        put_varint(&mut out, n);
        out
    })
}

fn len_field(tag: u32, body: impl Strategy<Value = Vec<u8>>) -> impl Strategy<Value = Vec<u8>> {
    body.prop_map(move |b| {
        let mut out = Vec::new();
        put_len(&mut out, tag, &b);
        out
    })
}

/// A message: its fields in any order and number, with unknown and mistyped ones among them.
fn message(known: BoxedStrategy<Vec<u8>>, max_tag: u32) -> BoxedStrategy<Vec<u8>> {
    let field = prop_oneof![8 => known, 2 => unknown(2), 1 => mistyped(max_tag)];
    prop::collection::vec(field, 0..6)
        .prop_map(|fields| fields.concat())
        .boxed()
}

fn raw_request() -> BoxedStrategy<Vec<u8>> {
    let entry = message(
        prop_oneof![len_field(1, text_bytes()), len_field(2, text_bytes())].boxed(),
        2,
    );
    let limit = message(prop_oneof![varint_field(1), varint_field(2)].boxed(), 2);
    let hits = message(varint_field(1).boxed(), 1);
    let descriptor = message(
        prop_oneof![
            3 => len_field(1, entry),
            1 => len_field(2, limit),
            1 => len_field(3, hits),
            1 => varint_field(4),
        ]
        .boxed(),
        4,
    );
    message(
        prop_oneof![
            len_field(1, text_bytes()),
            len_field(2, descriptor),
            varint_field(3),
        ]
        .boxed(),
        3,
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn prost_encoded_requests_read_as_prost_decodes_them(request in pb_request()) {
        let bytes = request.encode_to_vec();
        prop_assert_eq!(Ask::read(&bytes), Some(Ask::of(&request)));
    }

    /// Two messages one after the other are one message merged (the protobuf encoding): the
    /// last domain and hits_addend win, descriptors add up.
    #[test]
    fn concatenated_messages_merge_as_prost_merges_them(
        a in pb_request(),
        junk in prop::collection::vec(unknown(2), 0..3),
        b in pb_request(),
    ) {
        let mut bytes = a.encode_to_vec();
        bytes.extend(junk.concat());
        bytes.extend(b.encode_to_vec());
        agree(&bytes)?;
    }

    #[test]
    fn raw_messages_read_as_prost_decodes_them(bytes in raw_request()) {
        agree(&bytes)?;
    }

    #[test]
    fn cut_or_damaged_messages_fail_where_prost_fails(
        bytes in raw_request(),
        cut in any::<prop::sample::Index>(),
        at in any::<prop::sample::Index>(),
        byte in any::<u8>(),
    ) {
        if bytes.is_empty() {
            return Ok(());
        }
        agree(&bytes[..cut.index(bytes.len())])?;
        let mut damaged = bytes.clone();
        damaged[at.index(bytes.len())] = byte;
        agree(&damaged)?;
    }
}

#[test]
fn groups_nested_past_prosts_recursion_limit_fail_as_in_prost() {
    for depth in [98, 99, 100, 101] {
        let mut bytes = Vec::new();
        for _ in 0..depth {
            put_key(&mut bytes, 9, 3);
        }
        for _ in 0..depth {
            put_key(&mut bytes, 9, 4);
        }
        assert_eq!(
            RateLimitRequest::decode(&bytes[..]).is_ok(),
            Ask::read(&bytes).is_some(),
            "depth {depth}"
        );
        // The same inside a descriptor's entry.
        let mut entry = Vec::new();
        put_len(&mut entry, 1, b"k");
        entry.extend_from_slice(&bytes);
        let mut descriptor = Vec::new();
        put_len(&mut descriptor, 1, &entry);
        let mut request = Vec::new();
        put_len(&mut request, 2, &descriptor);
        assert_eq!(
            RateLimitRequest::decode(&request[..]).is_ok(),
            Ask::read(&request).is_some(),
            "depth {depth} in an entry"
        );
    }
}

#[test]
fn a_request_reads_to_its_fields() {
    let request = RateLimitRequest {
        domain: "edge".into(),
        descriptors: vec![RateLimitDescriptor {
            entries: vec![PbEntry {
                key: "user".into(),
                value: "alice".into(),
            }],
            limit: Some(RateLimitOverride {
                requests_per_unit: 7,
                unit: 2,
            }),
            hits_addend: Some(UInt64Value { value: 3 }),
            is_negative_hits: false,
        }],
        hits_addend: 2,
    };
    let bytes = request.encode_to_vec();
    let ask = Ask::read(&bytes).expect("reads");
    assert_eq!(ask.domain, "edge");
    assert_eq!(ask.hits_addend, 2);
    assert_eq!(ask.descriptors.len(), 1);
    assert_eq!(&ask.descriptors[0].entries[..], &[("user", "alice")]);
    assert_eq!(ask.descriptors[0].hits_addend, Some(3));
    let limit = ask.descriptors[0].limit.expect("an override");
    assert_eq!((limit.requests_per_unit, limit.unit), (7, 2));
}
