//! The client certificate a TLS listener verified (`crate::tls`): its subject and subject
//! alternative names, read once per connection and handed to every request on it (a request
//! extension), where `client_cert:` key parts read them (`crate::keys`). A leaf module: the
//! listener and the key extraction both use it, neither through the other.
//!
//! Only a certificate rustls has verified against the listener's client CA gets here, so its DER
//! is well formed; the reader below still refuses anything it does not understand (`None`)
//! rather than guess. The subject is written as RFC 4514 says (the order and escapes of
//! `openssl x509 -noout -subject -nameopt RFC2253`).

use std::fmt::Write as _;
use std::net::IpAddr;

/// A verified client certificate's identity.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClientCert {
    /// The subject, RFC 4514 (`CN=client-a,O=Example`).
    pub subject: Box<str>,
    /// Subject alternative names of each kind, in certificate order, joined by `,`; empty when
    /// the certificate has none of that kind.
    pub san_dns: Box<str>,
    pub san_uri: Box<str>,
    pub san_email: Box<str>,
    pub san_ip: Box<str>,
}

impl ClientCert {
    /// The identity in a leaf certificate's DER; `None` when it cannot be read.
    pub fn from_der(der: &[u8]) -> Option<ClientCert> {
        let (tag, cert, _) = tlv(der)?;
        if tag != SEQUENCE {
            return None;
        }
        let (tag, tbs, _) = tlv(cert)?;
        if tag != SEQUENCE {
            return None;
        }
        let mut rest = tbs;
        let mut next = || -> Option<(u8, &[u8])> {
            let (tag, value, after) = tlv(rest)?;
            rest = after;
            Some((tag, value))
        };
        let (mut tag, _) = next()?;
        // [0] EXPLICIT version, absent for v1.
        if tag == 0xA0 {
            (tag, _) = next()?;
        }
        if tag != INTEGER {
            return None;
        }
        let _signature = next()?;
        let _issuer = next()?;
        let _validity = next()?;
        let (tag, subject) = next()?;
        if tag != SEQUENCE {
            return None;
        }
        let _spki = next()?;
        let mut this = ClientCert {
            subject: rfc4514(subject)?.into(),
            ..ClientCert::default()
        };
        // issuerUniqueID [1], subjectUniqueID [2], extensions [3].
        while let Some((tag, value)) = next() {
            if tag == 0xA3 {
                this.read_extensions(value)?;
            }
        }
        Some(this)
    }

    fn read_extensions(&mut self, explicit: &[u8]) -> Option<()> {
        let (tag, mut list, _) = tlv(explicit)?;
        if tag != SEQUENCE {
            return None;
        }
        while !list.is_empty() {
            let (tag, extension, after) = tlv(list)?;
            list = after;
            if tag != SEQUENCE {
                return None;
            }
            let (tag, oid, mut rest) = tlv(extension)?;
            if tag != OID {
                return None;
            }
            let (mut tag, mut value, after) = tlv(rest)?;
            rest = after;
            // critical BOOLEAN DEFAULT FALSE
            if tag == 0x01 {
                (tag, value, _) = tlv(rest)?;
            }
            if tag != OCTET_STRING {
                return None;
            }
            if oid == SUBJECT_ALT_NAME {
                self.read_names(value)?;
            }
        }
        Some(())
    }

    fn read_names(&mut self, der: &[u8]) -> Option<()> {
        let (tag, mut names, _) = tlv(der)?;
        if tag != SEQUENCE {
            return None;
        }
        let (mut dns, mut uri, mut email, mut ip) =
            (String::new(), String::new(), String::new(), String::new());
        let add = |out: &mut String, text: &str| {
            if !out.is_empty() {
                out.push(',');
            }
            out.push_str(text);
        };
        while !names.is_empty() {
            let (tag, value, after) = tlv(names)?;
            names = after;
            match tag {
                0x81 => add(&mut email, std::str::from_utf8(value).ok()?),
                0x82 => add(&mut dns, std::str::from_utf8(value).ok()?),
                0x86 => add(&mut uri, std::str::from_utf8(value).ok()?),
                0x87 => {
                    let addr = match value.len() {
                        4 => IpAddr::from(<[u8; 4]>::try_from(value).ok()?),
                        16 => IpAddr::from(<[u8; 16]>::try_from(value).ok()?),
                        _ => return None,
                    };
                    add(&mut ip, &addr.to_string());
                }
                // otherName, x400Address, directoryName, ediPartyName, registeredID.
                _ => {}
            }
        }
        self.san_dns = dns.into();
        self.san_uri = uri.into();
        self.san_email = email.into();
        self.san_ip = ip.into();
        Some(())
    }
}

/// The verified client certificate of a TLS connection, when it sent one that reads.
pub fn of_connection(conn: &rustls::ServerConnection) -> Option<std::sync::Arc<ClientCert>> {
    let leaf = conn.peer_certificates()?.first()?;
    let cert = ClientCert::from_der(leaf.as_ref());
    if cert.is_none() {
        tracing::debug!(
            "a verified client certificate could not be read; no client_cert key parts"
        );
    }
    cert.map(std::sync::Arc::new)
}

const INTEGER: u8 = 0x02;
const OCTET_STRING: u8 = 0x04;
const OID: u8 = 0x06;
const SEQUENCE: u8 = 0x30;
const SET: u8 = 0x31;
/// 2.5.29.17
const SUBJECT_ALT_NAME: &[u8] = &[0x55, 0x1D, 0x11];

/// Attribute types by their short names (RFC 4514 §3, and `emailAddress` as OpenSSL writes it).
const NAMES: &[(&[u8], &str)] = &[
    (&[0x55, 0x04, 0x03], "CN"),
    (&[0x55, 0x04, 0x05], "serialNumber"),
    (&[0x55, 0x04, 0x06], "C"),
    (&[0x55, 0x04, 0x07], "L"),
    (&[0x55, 0x04, 0x08], "ST"),
    (&[0x55, 0x04, 0x09], "STREET"),
    (&[0x55, 0x04, 0x0A], "O"),
    (&[0x55, 0x04, 0x0B], "OU"),
    (
        &[0x09, 0x92, 0x26, 0x89, 0x93, 0xF2, 0x2C, 0x64, 0x01, 0x19],
        "DC",
    ),
    (
        &[0x09, 0x92, 0x26, 0x89, 0x93, 0xF2, 0x2C, 0x64, 0x01, 0x01],
        "UID",
    ),
    (
        &[0x2A, 0x86, 0x48, 0x86, 0xF7, 0x0D, 0x01, 0x09, 0x01],
        "emailAddress",
    ),
];

/// One DER element: (tag, contents, what follows). Single-byte tags and definite lengths only,
/// as DER has for every field read here.
fn tlv(input: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, rest) = input.split_first()?;
    let (&first, rest) = rest.split_first()?;
    let (len, rest) = if first < 0x80 {
        (usize::from(first), rest)
    } else {
        let n = usize::from(first & 0x7F);
        if n == 0 || n > 4 || rest.len() < n {
            return None;
        }
        let len = rest[..n]
            .iter()
            .fold(0usize, |acc, &b| (acc << 8) | usize::from(b));
        (len, &rest[n..])
    };
    if rest.len() < len {
        return None;
    }
    Some((tag, &rest[..len], &rest[len..]))
}

/// A Name (RDNSequence) as RFC 4514 writes it: the last RDN first, `,` between RDNs, `+`
/// between the attributes of one.
fn rfc4514(mut rdns: &[u8]) -> Option<String> {
    let mut parts = Vec::new();
    while !rdns.is_empty() {
        let (tag, mut set, after) = tlv(rdns)?;
        rdns = after;
        if tag != SET {
            return None;
        }
        let mut rdn = String::new();
        while !set.is_empty() {
            let (tag, attribute, after) = tlv(set)?;
            set = after;
            if tag != SEQUENCE {
                return None;
            }
            let (tag, oid, rest) = tlv(attribute)?;
            if tag != OID {
                return None;
            }
            if !rdn.is_empty() {
                rdn.push('+');
            }
            match NAMES.iter().find(|(known, _)| *known == oid) {
                Some((_, name)) => rdn.push_str(name),
                None => rdn.push_str(&dotted(oid)?),
            }
            rdn.push('=');
            let (tag, value, _) = tlv(rest)?;
            match string_value(tag, value) {
                Some(text) => escape(&text, &mut rdn),
                // RFC 4514 §2.4: a value of another type as `#` and its DER in hex.
                None => {
                    rdn.push('#');
                    for b in rest {
                        let _ = write!(rdn, "{b:02x}");
                    }
                }
            }
        }
        parts.push(rdn);
    }
    parts.reverse();
    Some(parts.join(","))
}

/// The text of a directory string.
fn string_value(tag: u8, value: &[u8]) -> Option<String> {
    match tag {
        // UTF8String, PrintableString, IA5String, NumericString, VisibleString
        0x0C | 0x13 | 0x16 | 0x12 | 0x1A => std::str::from_utf8(value).ok().map(str::to_owned),
        // TeletexString, read as Latin-1 (as OpenSSL does)
        0x14 => Some(value.iter().map(|&b| char::from(b)).collect()),
        // BMPString (UCS-2, big-endian)
        0x1E => {
            let units: Vec<u16> = value
                .chunks_exact(2)
                .map(|c| u16::from_be_bytes([c[0], c[1]]))
                .collect();
            String::from_utf16(&units).ok()
        }
        // UniversalString (UCS-4, big-endian)
        0x1C => value
            .chunks_exact(4)
            .map(|c| char::from_u32(u32::from_be_bytes([c[0], c[1], c[2], c[3]])))
            .collect(),
        _ => None,
    }
}

/// RFC 4514 §2.4 escapes.
fn escape(text: &str, out: &mut String) {
    let last = text.chars().count().saturating_sub(1);
    for (i, c) in text.chars().enumerate() {
        match c {
            ',' | '+' | '"' | '\\' | '<' | '>' | ';' => {
                out.push('\\');
                out.push(c);
            }
            '#' | ' ' if i == 0 => {
                out.push('\\');
                out.push(c);
            }
            ' ' if i == last => out.push_str("\\ "),
            '\0' => out.push_str("\\00"),
            c => out.push(c),
        }
    }
}

/// An OID in dotted decimal.
fn dotted(oid: &[u8]) -> Option<String> {
    let (&first, rest) = oid.split_first()?;
    let mut out = format!("{}.{}", first / 40, first % 40);
    let mut arc: u64 = 0;
    for &b in rest {
        arc = arc.checked_mul(128)? | u64::from(b & 0x7F);
        if b & 0x80 == 0 {
            let _ = write!(out, ".{arc}");
            arc = 0;
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_escaped_as_rfc_4514_says() {
        let mut out = String::new();
        escape("#a, b+c ", &mut out);
        assert_eq!(out, "\\#a\\, b\\+c\\ ");
    }

    #[test]
    fn an_unknown_attribute_type_is_written_in_dotted_decimal() {
        assert_eq!(
            dotted(&[0x2B, 0x06, 0x01, 0x04, 0x01, 0x82, 0x37]),
            Some("1.3.6.1.4.1.311".into())
        );
    }

    #[test]
    fn truncated_der_is_refused() {
        assert_eq!(tlv(&[0x30, 0x05, 0x01]), None);
        assert_eq!(ClientCert::from_der(&[0x30, 0x82, 0xFF]), None);
    }
}
