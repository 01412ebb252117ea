//! Calendar periods: windows that start at the top of a minute, hour, day, week, month
//! or year of the clock on the wall, in UTC or a named time zone.
//!
//! A billing quota resets on the first of the month, not 30 days after a caller's first
//! request. A [`Calendar`] says which wall clock and which unit. A fixed window of a
//! calendar quota ([`Quota::per_calendar`](crate::Quota::per_calendar)) counts from the
//! start of the unit to the start of the next:
//!
//! - a day in `Europe/Paris` is 23 hours on the last Sunday of March and 25 on the last
//!   Sunday of October;
//! - a month is 28 to 31 days, and a month across a change of summer time an hour less
//!   or more;
//! - a week starts on Monday (ISO 8601);
//! - a minute or an hour is a fixed length, aligned to the zone's offset (an hour in
//!   `Asia/Kolkata` starts at half past the UTC hour).
//!
//! A day that has no midnight (a zone whose clocks spring forward at 00:00) starts at
//! the first instant it has. The time zone database is the one bundled in the binary, so
//! every gateway computes the same boundaries whatever its system's files say. The Redis
//! store computes them on the gateway and sends them with the request, so Rust and Lua
//! decide alike.
//!
//! # Examples
//!
//! ```
//! use tollway_core::{Calendar, CalendarUnit};
//!
//! let month = Calendar::in_zone(CalendarUnit::Month, "Europe/Paris")?;
//! assert_eq!(month.to_string(), "calendar month in Europe/Paris");
//! // 2027-02-01T00:00+01:00, the start of February in Paris, in µs since the epoch.
//! let february = 1_801_436_400_000_000;
//! let (start, end, next) = month.window(february + 1);
//! assert_eq!(start, february);
//! assert_eq!(end - start, 28 * 86_400_000_000); // February 2027
//! // March loses the hour summer time takes.
//! assert_eq!(next - end, 31 * 86_400_000_000 - 3_600_000_000);
//! # Ok::<(), tollway_core::ConfigError>(())
//! ```

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use jiff::tz::TimeZone;
use jiff::{RoundMode, Timestamp, ToSpan, Unit, Zoned, ZonedRound};

use crate::error::ConfigError;

/// The unit a [`Calendar`] counts in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum CalendarUnit {
    /// From second 0 of a minute to the next.
    Minute,
    /// From minute 0 of an hour of the zone's clock to the next.
    Hour,
    /// From midnight to midnight.
    Day,
    /// From Monday's midnight to the next Monday's.
    Week,
    /// From midnight of the first day of a month to the next first.
    Month,
    /// From midnight of the first of January to the next.
    Year,
}

impl CalendarUnit {
    /// `minute`, `hour`, `day`, `week`, `month` or `year`.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            CalendarUnit::Minute => "minute",
            CalendarUnit::Hour => "hour",
            CalendarUnit::Day => "day",
            CalendarUnit::Week => "week",
            CalendarUnit::Month => "month",
            CalendarUnit::Year => "year",
        }
    }

    /// The unit named `name` (as [`name`](Self::name) spells it).
    #[must_use]
    pub fn named(name: &str) -> Option<Self> {
        [
            CalendarUnit::Minute,
            CalendarUnit::Hour,
            CalendarUnit::Day,
            CalendarUnit::Week,
            CalendarUnit::Month,
            CalendarUnit::Year,
        ]
        .into_iter()
        .find(|unit| unit.name() == name)
    }

    /// The longest a window of this unit can be: a summer time change makes a day 25
    /// hours, a month 31 days and an hour.
    #[must_use]
    pub const fn longest(self) -> Duration {
        const HOUR: u64 = 3_600;
        const DAY: u64 = 24 * HOUR;
        Duration::from_secs(match self {
            CalendarUnit::Minute => 60,
            CalendarUnit::Hour => HOUR,
            CalendarUnit::Day => DAY + HOUR,
            CalendarUnit::Week => 7 * DAY + HOUR,
            CalendarUnit::Month => 31 * DAY + HOUR,
            CalendarUnit::Year => 366 * DAY + HOUR,
        })
    }
}

/// A wall clock and a unit: where each window of a calendar quota starts and ends. See
/// the [module docs](self). Cloning is cheap.
#[derive(Clone)]
pub struct Calendar {
    unit: CalendarUnit,
    /// The zone's IANA name, or `UTC`.
    name: Arc<str>,
    zone: TimeZone,
}

impl Calendar {
    /// Windows of `unit` in UTC.
    #[must_use]
    pub fn utc(unit: CalendarUnit) -> Self {
        Calendar {
            unit,
            name: "UTC".into(),
            zone: TimeZone::UTC,
        }
    }

    /// Windows of `unit` on the wall clock of the IANA time zone `zone`
    /// (`Europe/Paris`, `America/New_York`).
    ///
    /// # Errors
    ///
    /// When the bundled time zone database has no zone of that name.
    pub fn in_zone(unit: CalendarUnit, zone: &str) -> Result<Self, ConfigError> {
        let found = TimeZone::get(zone).map_err(|_| {
            ConfigError::new(format!(
                "time zone {zone:?} is not in the time zone database: write an IANA name \
                 such as \"Europe/Paris\" or \"America/New_York\", or \"UTC\""
            ))
        })?;
        Ok(Calendar {
            unit,
            name: zone.into(),
            zone: found,
        })
    }

    /// The unit.
    #[must_use]
    pub fn unit(&self) -> CalendarUnit {
        self.unit
    }

    /// The zone's name: `UTC` or its IANA name.
    #[must_use]
    pub fn zone(&self) -> &str {
        &self.name
    }

    /// The window that holds `now` (µs since the Unix epoch): when it starts, when it
    /// ends, and when the one after it ends, in µs since the epoch.
    #[must_use]
    pub fn window(&self, now: u64) -> (u64, u64, u64) {
        self.civil_window(now).unwrap_or_else(|| {
            // Past what the calendar can say (beyond the year 9999): windows of the
            // longest length, aligned to the epoch.
            let length = u64::try_from(self.unit.longest().as_micros()).unwrap_or(u64::MAX);
            let start = now - now % length;
            (start, start + length, start + 2 * length)
        })
    }

    fn civil_window(&self, now: u64) -> Option<(u64, u64, u64)> {
        let at = Timestamp::from_microsecond(i64::try_from(now).ok()?).ok()?;
        let here = at.to_zoned(self.zone.clone());
        let truncated = |unit: Unit| {
            here.round(ZonedRound::new().smallest(unit).mode(RoundMode::Trunc))
                .ok()
        };
        let start = match self.unit {
            CalendarUnit::Minute => truncated(Unit::Minute)?,
            CalendarUnit::Hour => truncated(Unit::Hour)?,
            CalendarUnit::Day => here.start_of_day().ok()?,
            CalendarUnit::Week => {
                let back = i64::from(here.date().weekday().to_monday_zero_offset());
                let monday = here.date().checked_sub(back.days()).ok()?;
                monday.to_zoned(self.zone.clone()).ok()?
            }
            CalendarUnit::Month => here
                .date()
                .first_of_month()
                .to_zoned(self.zone.clone())
                .ok()?,
            CalendarUnit::Year => here
                .date()
                .first_of_year()
                .to_zoned(self.zone.clone())
                .ok()?,
        };
        let end = self.after(&start)?;
        let next = self.after(&end)?;
        let micros = |z: &Zoned| u64::try_from(z.timestamp().as_microsecond()).ok();
        Some((micros(&start)?, micros(&end)?, micros(&next)?))
    }

    /// The start of the window after the one starting at `start`.
    fn after(&self, start: &Zoned) -> Option<Zoned> {
        // Minutes and hours are lengths of time; days and longer are dates, which a
        // change of summer time lengthens or shortens. The next window starts at its
        // date's first instant.
        let next = match self.unit {
            CalendarUnit::Minute => return start.checked_add(1.minute()).ok(),
            CalendarUnit::Hour => return start.checked_add(1.hour()).ok(),
            CalendarUnit::Day => start.date().checked_add(1.day()).ok()?,
            CalendarUnit::Week => start.date().checked_add(1.week()).ok()?,
            CalendarUnit::Month => start.date().checked_add(1.month()).ok()?,
            CalendarUnit::Year => start.date().checked_add(1.year()).ok()?,
        };
        next.to_zoned(self.zone.clone()).ok()
    }
}

impl fmt::Display for Calendar {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "calendar {} in {}", self.unit.name(), self.name)
    }
}

impl fmt::Debug for Calendar {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Calendar")
            .field("unit", &self.unit)
            .field("zone", &self.name)
            .finish()
    }
}

impl PartialEq for Calendar {
    fn eq(&self, other: &Self) -> bool {
        (self.unit, &self.name) == (other.unit, &other.name)
    }
}

impl Eq for Calendar {}

impl std::hash::Hash for Calendar {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        (self.unit, &self.name).hash(state);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// µs since the epoch of a civil time in `zone`.
    fn at(zone: &str, civil: &str) -> u64 {
        let zoned = civil
            .parse::<jiff::civil::DateTime>()
            .unwrap()
            .to_zoned(TimeZone::get(zone).unwrap())
            .unwrap();
        u64::try_from(zoned.timestamp().as_microsecond()).unwrap()
    }

    const HOUR: u64 = 3_600_000_000;
    const DAY: u64 = 24 * HOUR;

    #[test]
    fn a_month_is_its_days_and_a_summer_time_change_moves_it_an_hour() {
        let paris = Calendar::in_zone(CalendarUnit::Month, "Europe/Paris").unwrap();
        // February 2028 (a leap year), then March, which loses an hour.
        let (start, end, next) = paris.window(at("Europe/Paris", "2028-02-15T12:00"));
        assert_eq!(start, at("Europe/Paris", "2028-02-01T00:00"));
        assert_eq!(end - start, 29 * DAY);
        assert_eq!(next - end, 31 * DAY - HOUR);
        // October gains it back.
        let (start, end, _) = paris.window(at("Europe/Paris", "2027-10-31T02:30"));
        assert_eq!(end - start, 31 * DAY + HOUR);
        // The last microsecond of a month is in it; the next is not.
        let last = at("Europe/Paris", "2027-03-01T00:00") - 1;
        assert_eq!(paris.window(last).1, last + 1);
        assert_eq!(paris.window(last + 1).0, last + 1);
    }

    #[test]
    fn days_weeks_and_hours_follow_the_wall_clock() {
        let ny = Calendar::in_zone(CalendarUnit::Day, "America/New_York").unwrap();
        let (start, end, _) = ny.window(at("America/New_York", "2027-03-14T12:00"));
        assert_eq!(end - start, 23 * HOUR);
        let week = Calendar::utc(CalendarUnit::Week);
        // 2027-01-07 is a Thursday: its week starts on Monday the 4th.
        let (start, end, _) = week.window(at("UTC", "2027-01-07T09:00"));
        assert_eq!(start, at("UTC", "2027-01-04T00:00"));
        assert_eq!(end - start, 7 * DAY);
        let kolkata = Calendar::in_zone(CalendarUnit::Hour, "Asia/Kolkata").unwrap();
        let (start, end, _) = kolkata.window(at("UTC", "2027-01-07T09:10"));
        assert_eq!(start, at("UTC", "2027-01-07T08:30"));
        assert_eq!(end - start, HOUR);
        let year = Calendar::utc(CalendarUnit::Year);
        let (start, end, next) = year.window(at("UTC", "2027-06-01T00:00"));
        assert_eq!((end - start, next - end), (365 * DAY, 366 * DAY));
    }

    #[test]
    fn an_unknown_zone_is_refused_with_what_to_write() {
        let err = Calendar::in_zone(CalendarUnit::Day, "Europe/Atlantis").unwrap_err();
        assert!(err.to_string().contains("IANA"), "{err}");
    }
}
