//! Calendar periods for quotas: which second, minute, hour, day, ISO week or month an instant
//! falls in, in a named time zone, as a half-open interval of epoch microseconds.
//!
//! Both stores compute the period here, in Rust, from their own clock (the in-process store) or
//! from the gateway's wall clock (Redis, whose script then keeps the newest period any instance
//! reached): Lua has no time-zone database, and the script must stay deterministic. A period
//! starts at local midnight of its first day; a DST change makes that day 23 or 25 hours long,
//! and a midnight that does not exist (a zone that springs forward at 00:00) starts the period at
//! the first instant that does. A second, minute or hour is that of the local clock: it starts
//! where the local time is a whole second, minute or hour, at the offset in force at the instant
//! (a zone 5:45 ahead of UTC starts its hours at a quarter past the UTC hour), and lasts exactly
//! that long.

use chrono::{DateTime, Datelike, Days, LocalResult, Months, NaiveDate, TimeZone};
use chrono_tz::Tz;

/// The length of a calendar quota's period.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Per {
    Second,
    Minute,
    Hour,
    Day,
    /// An ISO 8601 week: Monday 00:00 to the next Monday 00:00.
    Week,
    Month,
}

impl Per {
    /// The config word, also the suffix of the Redis key (`docs/redis.md`).
    pub fn as_str(self) -> &'static str {
        match self {
            Per::Second => "second",
            Per::Minute => "minute",
            Per::Hour => "hour",
            Per::Day => "day",
            Per::Week => "week",
            Per::Month => "month",
        }
    }

    pub fn parse(text: &str) -> Option<Per> {
        match text {
            "second" => Some(Per::Second),
            "minute" => Some(Per::Minute),
            "hour" => Some(Per::Hour),
            "day" => Some(Per::Day),
            "week" => Some(Per::Week),
            "month" => Some(Per::Month),
            _ => None,
        }
    }
}

/// The longest a period can last: a month of 31 days with an hour gained at a DST change.
pub fn longest_us(per: Per) -> u64 {
    const HOUR: u64 = 3_600_000_000;
    match per {
        Per::Second | Per::Minute | Per::Hour => fixed_us(per),
        Per::Day => 25 * HOUR,
        Per::Week => (7 * 24 + 1) * HOUR,
        Per::Month => (31 * 24 + 1) * HOUR,
    }
}

/// The length of a second, minute or hour (0 for the calendar's days, weeks and months).
fn fixed_us(per: Per) -> u64 {
    match per {
        Per::Second => 1_000_000,
        Per::Minute => 60_000_000,
        Per::Hour => 3_600_000_000,
        Per::Day | Per::Week | Per::Month => 0,
    }
}

/// One period: `[start, end)` in microseconds since the Unix epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Period {
    pub start: u64,
    pub end: u64,
}

/// The period of `per` in `tz` that contains `now_us` (microseconds since the Unix epoch).
pub fn period(per: Per, tz: Tz, now_us: u64) -> Period {
    let now = DateTime::from_timestamp_micros(i64::try_from(now_us).unwrap_or(i64::MAX))
        .unwrap_or(DateTime::UNIX_EPOCH);
    let local = now.with_timezone(&tz);
    let length = fixed_us(per);
    if length > 0 {
        use chrono::Offset;
        // The local clock's reading in µs, cut to the length, back at the same offset.
        let offset = i64::from(local.offset().fix().local_minus_utc()) * 1_000_000;
        let local_us = i64::try_from(now_us)
            .unwrap_or(i64::MAX)
            .saturating_add(offset);
        let into = local_us.rem_euclid(length as i64) as u64;
        let start = now_us - into.min(now_us);
        return Period {
            start,
            end: start.saturating_add(length),
        };
    }
    let today = local.date_naive();
    let first = match per {
        Per::Second | Per::Minute | Per::Hour => today,
        Per::Day => today,
        Per::Week => today - Days::new(u64::from(today.weekday().num_days_from_monday())),
        Per::Month => today.with_day(1).unwrap_or(today),
    };
    let next = match per {
        Per::Second | Per::Minute | Per::Hour | Per::Day => first + Days::new(1),
        Per::Week => first + Days::new(7),
        Per::Month => first + Months::new(1),
    };
    let start = midnight_us(tz, first).min(now_us);
    let end = midnight_us(tz, next).max(now_us.saturating_add(1));
    Period { start, end }
}

/// The first instant of `date` in `tz`, in epoch microseconds: its midnight, the earlier one when
/// midnight happens twice, the end of the gap when it does not happen at all.
fn midnight_us(tz: Tz, date: NaiveDate) -> u64 {
    let local = date.and_hms_opt(0, 0, 0).unwrap_or_default();
    let instant = match tz.from_local_datetime(&local) {
        LocalResult::Single(t) => t.timestamp_micros(),
        LocalResult::Ambiguous(earliest, _) => earliest.timestamp_micros(),
        // In a gap the clock jumps forward: midnight read with the offset in force before the
        // jump is the instant of the jump, which is the first local time of the day.
        LocalResult::None => {
            let before = tz.offset_from_local_datetime(&(local - Days::new(1)));
            let offset = before.earliest().map_or(0, |o| {
                use chrono::Offset;
                i64::from(o.fix().local_minus_utc())
            });
            (local.and_utc().timestamp() - offset) * 1_000_000
        }
    };
    u64::try_from(instant).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    const H: u64 = 3_600_000_000;

    fn at(text: &str) -> u64 {
        DateTime::parse_from_rfc3339(text)
            .unwrap()
            .timestamp_micros() as u64
    }

    #[test]
    fn berlin_days_around_dst_are_23_and_25_hours() {
        let tz = chrono_tz::Europe::Berlin;
        // 2026-03-29: clocks go 02:00 -> 03:00 local.
        let p = period(Per::Day, tz, at("2026-03-29T12:00:00+02:00"));
        assert_eq!(p.start, at("2026-03-29T00:00:00+01:00"));
        assert_eq!(p.end, at("2026-03-30T00:00:00+02:00"));
        assert_eq!(p.end - p.start, 23 * H);
        // 2026-10-25: clocks go 03:00 -> 02:00 local.
        let p = period(Per::Day, tz, at("2026-10-25T12:00:00+01:00"));
        assert_eq!(p.end - p.start, 25 * H);
        // The last microsecond of a day is in it; the next one starts the next day.
        let p = period(Per::Day, tz, at("2026-10-25T23:59:59.999999+01:00"));
        assert_eq!(p.end, at("2026-10-26T00:00:00+01:00"));
        let p = period(Per::Day, tz, at("2026-10-26T00:00:00+01:00"));
        assert_eq!(p.start, at("2026-10-26T00:00:00+01:00"));
    }

    #[test]
    fn weeks_start_on_monday_and_months_on_the_first() {
        let tz = chrono_tz::Europe::Berlin;
        // Sunday 2026-11-29 belongs to the week of Monday 2026-11-23.
        let p = period(Per::Week, tz, at("2026-11-29T23:00:00+01:00"));
        assert_eq!(p.start, at("2026-11-23T00:00:00+01:00"));
        assert_eq!(p.end, at("2026-11-30T00:00:00+01:00"));
        // February 2028 (leap year), then a month spanning the October DST change.
        let p = period(Per::Month, tz, at("2028-02-15T00:00:00+01:00"));
        assert_eq!(p.start, at("2028-02-01T00:00:00+01:00"));
        assert_eq!(p.end, at("2028-03-01T00:00:00+01:00"));
        let p = period(Per::Month, tz, at("2026-10-31T23:30:00+01:00"));
        assert_eq!(p.start, at("2026-10-01T00:00:00+02:00"));
        assert_eq!(p.end, at("2026-11-01T00:00:00+01:00"));
        // UTC 2026-11-30T23:30 is already December in Berlin.
        let p = period(Per::Month, tz, at("2026-11-30T23:30:00Z"));
        assert_eq!(p.start, at("2026-12-01T00:00:00+01:00"));
    }

    #[test]
    fn seconds_minutes_and_hours_follow_the_local_clock() {
        let p = period(Per::Second, chrono_tz::UTC, at("2026-12-02T05:30:00.250Z"));
        assert_eq!(p.start, at("2026-12-02T05:30:00Z"));
        assert_eq!(p.end, at("2026-12-02T05:30:01Z"));
        let p = period(
            Per::Minute,
            chrono_tz::UTC,
            at("2026-12-02T05:30:59.999999Z"),
        );
        assert_eq!(
            (p.start, p.end),
            (at("2026-12-02T05:30:00Z"), at("2026-12-02T05:31:00Z"))
        );
        // Kathmandu is 5:45 ahead: its hours start at a quarter past the UTC hour.
        let tz = chrono_tz::Asia::Kathmandu;
        let p = period(Per::Hour, tz, at("2026-12-02T05:20:00Z"));
        assert_eq!(p.start, at("2026-12-02T05:15:00Z"));
        assert_eq!(p.end - p.start, H);
        // The next period starts where this one ends.
        assert_eq!(period(Per::Hour, tz, p.end).start, p.end);
        // Berlin's 02:00-03:00 that does not exist on 2026-03-29: 01:xx then 03:00 (+02:00).
        let tz = chrono_tz::Europe::Berlin;
        let p = period(Per::Hour, tz, at("2026-03-29T01:30:00+01:00"));
        assert_eq!(p.end, at("2026-03-29T03:00:00+02:00"));
        assert_eq!(period(Per::Hour, tz, p.end).start, p.end);
    }

    #[test]
    fn a_missing_midnight_starts_the_day_at_the_jump() {
        // America/Santiago springs forward at 24:00 local: 2026-09-06 has no 00:00, the day
        // starts at 01:00 (-03:00).
        let tz = chrono_tz::America::Santiago;
        let p = period(Per::Day, tz, at("2026-09-06T12:00:00-03:00"));
        assert_eq!(p.start, at("2026-09-06T01:00:00-03:00"));
        assert_eq!(p.end, at("2026-09-07T00:00:00-03:00"));
        assert_eq!(p.end - p.start, 23 * H);
    }
}
