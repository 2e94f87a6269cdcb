//! What a `ShouldRateLimit` asks, borrowed: the few fields [`super::plan`], [`super::decide`] and
//! [`super::metadata`] read, either from prost's decoded message (tonic, `POST /json`) or read in
//! place from the message bytes (`super::wire`, the hot path).
//!
//! Why read in place: prost's decoding allocates a `String` per domain, key and value and a `Vec`
//! per descriptor: with their drops about 2.5k of the 39.5k instructions of a call on the memory
//! store, against 0.6k here (`docs/benchmarks.md`, "Issue 14, seventh pass: the RLS call").
//! [`Ask::read`] follows the protobuf encoding
//! as prost decodes it (unknown fields skipped, groups included; the last value of a scalar
//! wins; repeated occurrences of a message field merge; strings must be UTF-8; the same
//! recursion limit), and fails wherever prost fails; the property tests below check both on
//! random messages (`ask/tests.rs`). On any failure the caller decodes with prost, for prost's
//! error message.

use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use smallvec::SmallVec;

use super::rule::Entry;

/// Envoy's per-descriptor limit override (`RateLimitOverride`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Override {
    pub(crate) requests_per_unit: u32,
    /// `RateLimitUnit` as sent (unknown values kept, as prost keeps them).
    pub(crate) unit: i32,
}

/// One `RateLimitDescriptor`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct AskDescriptor<'a> {
    pub(crate) entries: SmallVec<[Entry<'a>; 4]>,
    pub(crate) limit: Option<Override>,
    /// `hits_addend` (a `google.protobuf.UInt64Value`).
    pub(crate) hits_addend: Option<u64>,
}

/// One `RateLimitRequest`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Ask<'a> {
    pub(crate) domain: &'a str,
    pub(crate) descriptors: SmallVec<[AskDescriptor<'a>; 2]>,
    pub(crate) hits_addend: u32,
}

impl<'a> Ask<'a> {
    /// The fields of prost's message.
    pub(crate) fn of(request: &'a RateLimitRequest) -> Self {
        Ask {
            domain: &request.domain,
            descriptors: request
                .descriptors
                .iter()
                .map(|d| AskDescriptor {
                    entries: d
                        .entries
                        .iter()
                        .map(|e| (e.key.as_str(), e.value.as_str()))
                        .collect(),
                    limit: d.limit.as_ref().map(|l| Override {
                        requests_per_unit: l.requests_per_unit,
                        unit: l.unit,
                    }),
                    hits_addend: d.hits_addend.as_ref().map(|h| h.value),
                })
                .collect(),
            hits_addend: request.hits_addend,
        }
    }

    /// Reads an encoded `RateLimitRequest` in place; `None` wherever prost's decoding fails.
    pub(crate) fn read(message: &'a [u8]) -> Option<Self> {
        let mut ask = Ask::default();
        let mut r = Reader { buf: message };
        while !r.buf.is_empty() {
            let (tag, wire) = r.key()?;
            match (tag, wire) {
                (1, LEN) => ask.domain = r.text()?,
                (2, LEN) => {
                    let mut descriptor = AskDescriptor::default();
                    r.message(LIMIT, |r, tag, wire| {
                        read_descriptor(&mut descriptor, r, tag, wire, LIMIT - 1)
                    })?;
                    ask.descriptors.push(descriptor);
                }
                (3, VARINT) => ask.hits_addend = r.varint()? as u32,
                (1..=3, _) => return None,
                _ => r.skip(tag, wire, LIMIT)?,
            }
        }
        Some(ask)
    }
}

/// prost's recursion limit (`prost::RECURSION_LIMIT`): nested messages and groups deeper than
/// this fail.
const LIMIT: u32 = 100;

// Wire types.
const VARINT: u8 = 0;
const I64: u8 = 1;
const LEN: u8 = 2;
const START_GROUP: u8 = 3;
const END_GROUP: u8 = 4;
const I32: u8 = 5;

/// One field of a `RateLimitDescriptor`; `depth` is the recursion depth left inside it (prost's
/// `DecodeContext`).
fn read_descriptor<'a>(
    d: &mut AskDescriptor<'a>,
    r: &mut Reader<'a>,
    tag: u32,
    wire: u8,
    depth: u32,
) -> Option<()> {
    match (tag, wire) {
        (1, LEN) => {
            let (mut key, mut value) = ("", "");
            r.message(depth, |r, tag, wire| match (tag, wire) {
                (1, LEN) => r.text().map(|t| key = t),
                (2, LEN) => r.text().map(|t| value = t),
                (1 | 2, _) => None,
                _ => r.skip(tag, wire, depth - 1),
            })?;
            d.entries.push((key, value));
        }
        (2, LEN) => {
            // A repeated message field merges into the one already read.
            let limit = d.limit.get_or_insert_with(Override::default);
            r.message(depth, |r, tag, wire| match (tag, wire) {
                (1, VARINT) => r.varint().map(|v| limit.requests_per_unit = v as u32),
                (2, VARINT) => r.varint().map(|v| limit.unit = v as i32),
                (1 | 2, _) => None,
                _ => r.skip(tag, wire, depth - 1),
            })?;
        }
        (3, LEN) => {
            let hits = d.hits_addend.get_or_insert(0);
            r.message(depth, |r, tag, wire| match (tag, wire) {
                (1, VARINT) => r.varint().map(|v| *hits = v),
                (1, _) => None,
                _ => r.skip(tag, wire, depth - 1),
            })?;
        }
        // `is_negative_hits` (bool): not used, but read as prost reads it.
        (4, VARINT) => {
            r.varint()?;
        }
        (1..=4, _) => return None,
        _ => r.skip(tag, wire, depth)?,
    }
    Some(())
}

/// The protobuf wire format over a byte slice, as prost reads it.
struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    /// A varint of at most 10 bytes, the tenth at most 1 (no overflow of 64 bits).
    fn varint(&mut self) -> Option<u64> {
        // Keys and short lengths: one byte.
        if let [byte @ 0..0x80, rest @ ..] = self.buf {
            self.buf = rest;
            return Some(u64::from(*byte));
        }
        let mut value = 0u64;
        for (i, &byte) in self.buf.iter().take(10).enumerate() {
            value |= u64::from(byte & 0x7f) << (7 * i);
            if byte < 0x80 {
                if i == 9 && byte > 1 {
                    return None;
                }
                self.buf = &self.buf[i + 1..];
                return Some(value);
            }
        }
        None
    }

    /// A field key: its tag (at least 1) and wire type (0-5).
    fn key(&mut self) -> Option<(u32, u8)> {
        let key = u32::try_from(self.varint()?).ok()?;
        let wire = (key & 7) as u8;
        let tag = key >> 3;
        (wire <= I32 && tag >= 1).then_some((tag, wire))
    }

    /// A length-delimited field's bytes.
    fn bytes(&mut self) -> Option<&'a [u8]> {
        let len = usize::try_from(self.varint()?).ok()?;
        if len > self.buf.len() {
            return None;
        }
        let (bytes, rest) = self.buf.split_at(len);
        self.buf = rest;
        Some(bytes)
    }

    fn text(&mut self) -> Option<&'a str> {
        std::str::from_utf8(self.bytes()?).ok()
    }

    /// An embedded message, each of its fields handed to `field`; `depth` is the recursion depth
    /// left where it is read (prost fails on entering a message with none left; its fields are
    /// read with one less).
    fn message(
        &mut self,
        depth: u32,
        mut field: impl FnMut(&mut Reader<'a>, u32, u8) -> Option<()>,
    ) -> Option<()> {
        if depth == 0 {
            return None;
        }
        let mut inner = Reader { buf: self.bytes()? };
        while !inner.buf.is_empty() {
            let (tag, wire) = inner.key()?;
            field(&mut inner, tag, wire)?;
        }
        Some(())
    }

    /// Skips an unknown field (a group to its matching end).
    fn skip(&mut self, tag: u32, wire: u8, depth: u32) -> Option<()> {
        if depth == 0 {
            return None;
        }
        match wire {
            VARINT => {
                self.varint()?;
            }
            I64 => self.advance(8)?,
            I32 => self.advance(4)?,
            LEN => {
                self.bytes()?;
            }
            START_GROUP => loop {
                let (inner_tag, inner_wire) = self.key()?;
                if inner_wire == END_GROUP {
                    if inner_tag != tag {
                        return None;
                    }
                    break;
                }
                self.skip(inner_tag, inner_wire, depth - 1)?;
            },
            _ => return None,
        }
        Some(())
    }

    fn advance(&mut self, n: usize) -> Option<()> {
        self.buf = self.buf.get(n..)?;
        Some(())
    }
}

#[cfg(test)]
mod tests;
