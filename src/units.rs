//! The small languages inside config strings: durations (`500ms`, `1m`), rates (`10/s`) and sizes
//! (`10MiB`). Each error message says what is allowed.

use std::time::Duration;

const DURATION_HELP: &str =
    "expected a whole number with a unit: ms, s, m, h or d (e.g. 500ms, 10s, 1m), at most 365d";
const RATE_HELP: &str =
    "expected N/s, N/m, N/h or N/d with N > 0 (e.g. 10/s, 0.5/s, 100/m), at least one a year (0.00274/d)";

/// The longest duration any field takes: a year. Past it, microsecond arithmetic on timestamps
/// (a window, a timeout added to a clock) is one step from overflow, and no rate limit or timeout
/// means anything at that scale.
pub const MAX_DURATION: Duration = Duration::from_secs(365 * 86_400);

/// The slowest rate: one unit a year, so that `Retry-After` (cost / rate) stays within years,
/// not the 10¹³ seconds a rate of `1e-30/s` gives.
pub const MIN_RATE: f64 = 1.0 / (365.0 * 86_400.0);
const SIZE_HELP: &str = "expected bytes, or a number with B, KiB, MiB or GiB (e.g. 10MiB)";

/// Parses `500ms`, `10s`, `1m`, `1h`, `1d`.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .ok_or_else(|| format!("`{text}` has no unit; {DURATION_HELP}"))?;
    let (digits, unit) = text.split_at(split);
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("`{text}` is not a duration; {DURATION_HELP}"))?;
    let ms_per_unit = match unit {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => {
            return Err(format!(
                "`{text}` has an unknown unit `{unit}`; {DURATION_HELP}"
            ))
        }
    };
    n.checked_mul(ms_per_unit)
        .map(Duration::from_millis)
        .filter(|d| *d <= MAX_DURATION)
        .ok_or_else(|| format!("`{text}` is too long; {DURATION_HELP}"))
}

/// Parses `N/s`, `N/m`, `N/h`, `N/d` into units per second. N may be fractional (`0.5/s`).
pub fn parse_rate(text: &str) -> Result<f64, String> {
    let text = text.trim();
    let (n, unit) = text
        .split_once('/')
        .ok_or_else(|| format!("`{text}` is not a rate; {RATE_HELP}"))?;
    let n: f64 = n
        .trim()
        .parse()
        .map_err(|_| format!("`{text}` is not a rate; {RATE_HELP}"))?;
    let seconds = match unit.trim() {
        "s" => 1.0,
        "m" => 60.0,
        "h" => 3_600.0,
        "d" => 86_400.0,
        other => {
            return Err(format!(
                "`{text}` has an unknown unit `{other}`; {RATE_HELP}"
            ))
        }
    };
    if !(n.is_finite() && n > 0.0) {
        return Err(format!("`{text}` must be positive; {RATE_HELP}"));
    }
    let rate = n / seconds;
    // A little slack: `1/365d` itself must pass despite rounding.
    if rate < MIN_RATE * (1.0 - 1e-12) {
        return Err(format!("`{text}` is too slow; {RATE_HELP}"));
    }
    Ok(rate)
}

/// Parses `1048576`, `512B`, `64KiB`, `10MiB`, `1GiB`.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (digits, unit) = text.split_at(split);
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("`{text}` is not a size; {SIZE_HELP}"))?;
    let multiplier: u64 = match unit {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        _ => {
            return Err(format!(
                "`{text}` has an unknown unit `{unit}`; {SIZE_HELP}"
            ))
        }
    };
    n.checked_mul(multiplier)
        .ok_or_else(|| format!("`{text}` is too large"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("1m"), Ok(Duration::from_secs(60)));
        assert_eq!(parse_duration("1d"), Ok(Duration::from_secs(86_400)));
        assert!(parse_duration("10").unwrap_err().contains("no unit"));
        assert!(parse_duration("10x")
            .unwrap_err()
            .contains("unknown unit `x`"));
        assert!(parse_duration("-1s").is_err());
        assert_eq!(parse_duration("365d"), Ok(MAX_DURATION));
    }

    #[test]
    fn durations_that_overflow_microseconds_are_too_long() {
        // 18446744073709552 ms is past u64::MAX microseconds: it used to wrap to ~384 µs.
        for text in [
            "18446744073709552ms",
            "18446744073709551615d",
            "366d",
            "31536000001ms",
        ] {
            let e = parse_duration(text).unwrap_err();
            assert!(
                e.contains("too long") && e.contains("at most 365d"),
                "{text}: {e}"
            );
        }
    }

    #[test]
    fn rates_below_one_a_year_are_too_slow() {
        assert!(parse_rate("1/365d").is_err(), "365d is not a rate unit");
        assert!(parse_rate("0.00274/d").is_ok());
        let e = parse_rate("1e-30/s").unwrap_err();
        assert!(
            e.contains("too slow") && e.contains("at least one a year"),
            "{e}"
        );
        assert!(parse_rate("inf/s").is_err());
        assert!(parse_rate("NaN/s").is_err());
    }

    #[test]
    fn rates() {
        assert_eq!(parse_rate("10/s"), Ok(10.0));
        assert_eq!(parse_rate("120/m"), Ok(2.0));
        assert_eq!(parse_rate("0.5/s"), Ok(0.5));
        assert!(parse_rate("0/s").is_err());
        assert!(parse_rate("10/w").unwrap_err().contains("unknown unit"));
        assert!(parse_rate("10").is_err());
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("1024"), Ok(1024));
        assert_eq!(parse_size("10MiB"), Ok(10 << 20));
        assert!(parse_size("10MB").is_err());
        assert!(parse_size("18446744073709551615GiB")
            .unwrap_err()
            .contains("too large"));
    }
}
