//! The small languages of nginx inside annotation values, read into Turnstile's: variables in a
//! rate-limit key, Go durations (what ingress-nginx's controller parses windows with) and nginx
//! sizes.

/// nginx variables in `global-rate-limit-key` to Turnstile key parts. nginx lowercases header
/// names and writes `-` as `_` in `$http_NAME`; HTTP field names are case-insensitive (RFC 9110
/// §5.1), so `header:NAME` with `-` is the same field. Literal text between variables is
/// constant, so it does not change which requests share a counter, and is dropped.
pub fn nginx_key(text: &str) -> Result<Vec<String>, String> {
    let mut parts = Vec::new();
    let mut rest = text;
    while let Some(i) = rest.find('$') {
        let after = &rest[i + 1..];
        let (name, next) = match after.strip_prefix('{') {
            Some(braced) => match braced.find('}') {
                Some(end) => (&braced[..end], &braced[end + 1..]),
                None => return Err("an unclosed `${`".to_string()),
            },
            None => {
                let end = after
                    .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                    .unwrap_or(after.len());
                (&after[..end], &after[end..])
            }
        };
        let part = match name {
            "remote_addr" | "binary_remote_addr" => "client_ip".to_string(),
            "host" => "host".to_string(),
            "request_method" => "method".to_string(),
            _ => match (name.strip_prefix("http_"), name.strip_prefix("arg_")) {
                (Some(header), _) if !header.is_empty() => {
                    format!("header:{}", header.to_ascii_lowercase().replace('_', "-"))
                }
                (_, Some(arg)) if !arg.is_empty() => format!("query:{arg}"),
                _ => {
                    return Err(format!(
                        "`${name}` has no Turnstile key part (mapped: $remote_addr, $http_NAME, $arg_NAME, $host, $request_method)"
                    ))
                }
            },
        };
        if !parts.contains(&part) {
            parts.push(part);
        }
        rest = next;
    }
    if parts.is_empty() {
        return Err("no variable: one counter for every client".to_string());
    }
    Ok(parts)
}

/// A Go duration (`1m`, `30s`, `1h30m`, `1.5h`, `500ms`) as a Turnstile duration in its largest
/// whole unit; `None` when not a positive whole number of milliseconds up to Turnstile's longest
/// duration, 365d.
pub fn go_duration(text: &str) -> Option<String> {
    let mut rest = text.trim();
    let mut micros: f64 = 0.0;
    if rest.is_empty() {
        return None;
    }
    while !rest.is_empty() {
        let end = rest.find(|c: char| !(c.is_ascii_digit() || c == '.'))?;
        let n: f64 = rest[..end].parse().ok()?;
        rest = &rest[end..];
        let unit_end = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let per = match &rest[..unit_end] {
            "us" | "µs" => 1.0,
            "ms" => 1e3,
            "s" => 1e6,
            "m" => 60e6,
            "h" => 3600e6,
            _ => return None,
        };
        micros += n * per;
        rest = &rest[unit_end..];
    }
    let ms = micros / 1e3;
    if !(ms.is_finite() && ms >= 1.0 && ms.fract() == 0.0 && ms < 1e15) {
        return None;
    }
    let ms = ms as u64;
    if u128::from(ms) > crate::config::units::MAX_DURATION.as_millis() {
        return None;
    }
    Some(
        [
            (86_400_000, "d"),
            (3_600_000, "h"),
            (60_000, "m"),
            (1_000, "s"),
        ]
        .iter()
        .find(|(per, _)| ms.is_multiple_of(*per))
        .map_or_else(
            || format!("{ms}ms"),
            |(per, unit)| format!("{}{unit}", ms / per),
        ),
    )
}

/// An nginx size (`1024`, `8k`, `8m`, `1g`) in bytes.
pub fn nginx_size(text: &str) -> Option<u64> {
    let text = text.trim();
    let (digits, multiplier) = match text.chars().last()? {
        'k' | 'K' => (&text[..text.len() - 1], 1u64 << 10),
        'm' | 'M' => (&text[..text.len() - 1], 1 << 20),
        'g' | 'G' => (&text[..text.len() - 1], 1 << 30),
        _ => (text, 1),
    };
    digits.parse::<u64>().ok()?.checked_mul(multiplier)
}

/// Bytes as a Turnstile size, in the largest binary unit that divides them.
pub fn turnstile_size(bytes: u64) -> String {
    [(1u64 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")]
        .iter()
        .find(|(per, _)| bytes >= *per && bytes.is_multiple_of(*per))
        .map_or_else(
            || format!("{bytes}B"),
            |(per, unit)| format!("{}{unit}", bytes / per),
        )
}
