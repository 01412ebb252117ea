//! A limits file read and validated: its policies, tiers, routes, lists and settings,
//! each error at its `file:line:column`.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::ops::Range;
use std::path::Path;
use std::time::Duration;

use tollway_core::{
    Algorithm, Calendar, CalendarUnit, ConfigError, MAX_UNITS, MemoryStore, Policy, Quota,
};
use toml::Spanned;

use super::follow;
use super::schema::{DEPTH, File, PolicySection};
use crate::headers::HeaderStyle;
use crate::pipeline::OnStoreError;
use crate::rate_limit::RateLimitLayerBuilder;

/// A limits file, read and validated: every policy, tier, route, list entry and setting
/// in it is usable. See the [module docs](crate::config) for what it may say.
pub struct LimitsFile {
    pub(super) name: String,
    pub(super) text: String,
    pub(super) file: File,
    /// The policies, validated, by name.
    pub(super) policies: BTreeMap<String, Policy>,
}

impl fmt::Debug for LimitsFile {
    /// The name and the policies: the file's text holds API keys.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LimitsFile")
            .field("name", &self.name)
            .field("policies", &self.policies.keys())
            .finish_non_exhaustive()
    }
}
impl LimitsFile {
    /// Reads and validates the file at `path`: a regular file of at most 1 MiB (a FIFO
    /// in its place is refused, not waited on).
    ///
    /// # Errors
    ///
    /// When it cannot be read, is not a regular file, is over 1 MiB, or says something
    /// tollway cannot do: the message starts
    /// with `path:line:column:` and says what to write instead.
    pub fn read(path: impl AsRef<Path>) -> Result<Self, ConfigError> {
        let path = path.as_ref();
        let bytes = follow::read_bytes(path, follow::MAX_FILE_SIZE)?;
        Self::from_bytes(&path.display().to_string(), &bytes)
    }

    /// Validates `bytes`, a limits file called `name` in its messages, which must be
    /// UTF-8 text.
    ///
    /// # Errors
    ///
    /// As [`read`](Self::read); a byte that is not UTF-8 is named by its line and column.
    pub fn from_bytes(name: &str, bytes: &[u8]) -> Result<Self, ConfigError> {
        match std::str::from_utf8(bytes) {
            Ok(text) => Self::parse(name, text),
            Err(e) => {
                let good = &bytes[..e.valid_up_to()];
                let good = std::str::from_utf8(good).unwrap_or_default();
                Err(locate(
                    name,
                    good,
                    Some(good.len()..good.len()),
                    &format!(
                        "byte 0x{:02x} is not UTF-8: save the file as UTF-8 text",
                        bytes[e.valid_up_to()]
                    ),
                ))
            }
        }
    }

    /// Validates `text`, a limits file called `name` in its messages.
    ///
    /// # Errors
    ///
    /// As [`read`](Self::read).
    pub fn parse(name: &str, text: &str) -> Result<Self, ConfigError> {
        let at = |span: Option<Range<usize>>, message: &str| locate(name, text, span, message);
        let file: File = toml::from_str(text).map_err(|e| {
            // serde's words for a `Switch` that is neither: say what to write instead.
            let message = if e.message().contains("untagged enum Switch") {
                "write breaker = false, true or { threshold = 5, cool_down_ms = 250 }; \
                 local_fallback = false, true or a share of each quota like 0.1; and \
                 leases = false, true or { horizon_ms = 200, min_units = 8, max_share = 0.1 }"
                    .to_owned()
            } else if e.message() == "recursion limit" {
                format!(
                    "this key has more parts than toml reads; tollway's keys have at most \
                     {DEPTH}, like policies.api.limit: write the key as the module docs show"
                )
            } else {
                redact_strings(e.message())
            };
            at(e.span().or_else(|| line_of(text, e.message())), &message)
        })?;
        let mut policies = BTreeMap::new();
        for (policy_name, section) in &file.policies {
            let policy = policy(policy_name, section.get_ref())
                .map_err(|(span, message)| at(Some(span.unwrap_or(section.span())), &message))?;
            policies.insert(policy_name.clone(), policy);
        }
        let limits = LimitsFile {
            name: name.to_owned(),
            text: text.to_owned(),
            file,
            policies,
        };
        // Everything else is checked by building a layer with it, over a throwaway store.
        limits
            .builder(MemoryStore::new(), limits.key()?)
            .and_then(RateLimitLayerBuilder::build)?;
        Ok(limits)
    }

    /// The file's name, as its messages give it.
    #[must_use]
    pub fn name(&self) -> &str {
        &self.name
    }

    /// `[key] ipv6_prefix`: how many bits of an IPv6 address make a caller (default 64).
    pub(super) fn ipv6_prefix(&self) -> u8 {
        let key = self.file.key.as_ref().map(Spanned::get_ref);
        key.and_then(|k| k.ipv6_prefix.as_ref())
            .map_or(64, |bits| *bits.get_ref())
    }

    /// The names of the file's policies.
    pub fn policy_names(&self) -> impl Iterator<Item = &str> {
        self.policies.keys().map(String::as_str)
    }

    /// `[layer] headers`: which rate-limit headers responses carry (default legacy).
    #[must_use]
    pub fn header_style(&self) -> HeaderStyle {
        self.try_header_style().unwrap_or(HeaderStyle::Legacy)
    }

    /// `[layer] on_store_error`: what to answer when the store cannot decide (default
    /// allow).
    #[must_use]
    pub fn on_store_error(&self) -> OnStoreError {
        self.try_on_store_error().unwrap_or(OnStoreError::Allow)
    }

    /// Whether the file puts the whole layer (`None`) or the named policy in shadow mode.
    #[must_use]
    pub fn is_shadow(&self, policy: Option<&str>) -> bool {
        match policy {
            None => self.file.layer.shadow,
            Some(name) => self
                .file
                .policies
                .get(name)
                .is_some_and(|p| p.get_ref().shadow),
        }
    }

    /// The API keys the file names: in `[tiers]` and `[plans]`, and as `key:` entries of the lists (a
    /// key on the deny list must be seen to be denied).
    pub(super) fn known_keys(&self) -> HashSet<String> {
        let lists = &self.file.lists;
        let listed = lists.allow_keys.iter().chain(&lists.deny_keys);
        let listed = listed.filter_map(|k| k.get_ref().strip_prefix("key:").map(str::to_owned));
        let tiers = self.keyed_tiers().map(|(k, _)| k.get_ref().clone());
        tiers.chain(listed).collect()
    }

    /// Each API key the file gives a tier, in `[tiers]` or `[plans]`, with its tier.
    pub(super) fn keyed_tiers(&self) -> impl Iterator<Item = (&Spanned<String>, &Spanned<String>)> {
        let plans = self.file.plans.iter().map(|(k, p)| (k, &p.get_ref().tier));
        self.file.tiers.iter().chain(plans)
    }

    pub(super) fn tier_map(&self) -> HashMap<String, String> {
        self.file
            .tiers
            .iter()
            .map(|(key, tier)| (key.get_ref().clone(), tier.get_ref().clone()))
            .collect()
    }

    pub(super) fn policy_named(&self, name: &Spanned<String>) -> Result<&Policy, ConfigError> {
        self.policies.get(name.get_ref()).ok_or_else(|| {
            let known: Vec<&str> = self.policies.keys().map(String::as_str).collect();
            self.at(
                Some(name.span()),
                &format!(
                    "no policy is named {:?}: name one of {known:?}, or add [policies.{}]",
                    name.get_ref(),
                    name.get_ref()
                ),
            )
        })
    }

    pub(super) fn choice(
        &self,
        value: &Spanned<String>,
        what: &str,
        choices: &[&str],
    ) -> ConfigError {
        self.at(
            Some(value.span()),
            &format!(
                "{what} = {:?} is not one tollway knows: write one of {choices:?}",
                value.get_ref()
            ),
        )
    }

    pub(super) fn at(&self, span: Option<Range<usize>>, message: &str) -> ConfigError {
        locate(&self.name, &self.text, span, message)
    }

    pub(super) fn err(&self, span: Option<Range<usize>>, error: ConfigError) -> ConfigError {
        self.at(span, &error.to_string())
    }

    /// Whether `other` keeps this file's store and keys, which a reload cannot change.
    pub(super) fn same_foundations(&self, other: &LimitsFile) -> Result<(), ConfigError> {
        let (old, new) = (&self.file, &other.file);
        if old.store.as_ref().map(Spanned::get_ref) != new.store.as_ref().map(Spanned::get_ref) {
            return Err(other.at(
                new.store.as_ref().map(Spanned::span),
                "[store] changed: the store is chosen at start; restart to use the new one \
                 (the running limits stay)",
            ));
        }
        if old.key.as_ref().map(Spanned::get_ref) != new.key.as_ref().map(Spanned::get_ref) {
            return Err(other.at(
                new.key.as_ref().map(Spanned::span),
                "[key] changed: how keys are found is chosen at start; restart to use it \
                 (the running limits stay)",
            ));
        }
        Ok(())
    }
}

/// A validated policy, or the span and message of what is wrong with it.
pub(super) fn policy(
    name: &str,
    section: &PolicySection,
) -> Result<Policy, (Option<Range<usize>>, String)> {
    let algorithm = Algorithm::ALL
        .into_iter()
        .find(|a| a.name() == section.algorithm.get_ref())
        .ok_or_else(|| {
            let names: Vec<&str> = Algorithm::ALL.iter().map(|a| a.name()).collect();
            (
                Some(section.algorithm.span()),
                format!(
                    "algorithm {:?} is not one tollway knows: write one of {names:?}",
                    section.algorithm.get_ref()
                ),
            )
        })?;
    let limit = limit_units(name, &section.limit)?;
    let quota = match section.period.get_ref().strip_prefix("calendar ") {
        Some(unit) => calendar_quota(name, section, limit, unit)?,
        None => {
            if let Some(zone) = &section.zone {
                return Err((
                    Some(zone.span()),
                    format!(
                        "policy {name:?}: a zone is a calendar period's: write period = \
                         \"calendar day\" (or minute, hour, week, month, year), or remove zone"
                    ),
                ));
            }
            let period = parse_period(section.period.get_ref()).ok_or_else(|| {
                (
                    Some(section.period.span()),
                    format!(
                        "policy {name:?}: period = {:?} is not a period: write \"1s\", \"1m\", \
                         \"1h\", \"1d\", \"250ms\" or \"calendar month\"",
                        section.period.get_ref()
                    ),
                )
            })?;
            Quota::with_period(limit, period)
                .map_err(|e| (Some(section.period.span()), e.to_string()))?
        }
    };
    let quota = with_burst(name, quota, section.burst.as_ref())?;
    Policy::new(name, algorithm, quota)
        .map_err(|e| misfit(e, &section.limit, section.burst.as_ref()))
}

/// The policy named `tier` at a key's own `limit` and `burst` (a `[plans]` entry): its
/// quota, over the tier's period.
pub(super) fn plan_quota(
    tier: &Policy,
    limit: &Spanned<i64>,
    burst: Option<&Spanned<i64>>,
) -> Result<Quota, (Option<Range<usize>>, String)> {
    let name = tier.name();
    let units = limit_units(name, limit)?;
    let quota = tier
        .quota()
        .with_limit(units)
        .map_err(|e| (Some(limit.span()), e.to_string()))?;
    let quota = with_burst(name, quota, burst)?;
    tier.with_quota(quota.clone())
        .map_err(|e| misfit(e, limit, burst))?;
    Ok(quota)
}

/// A `limit` as written for policy `name`: 1 to 2^53.
fn limit_units(name: &str, limit: &Spanned<i64>) -> Result<u64, (Option<Range<usize>>, String)> {
    let value = *limit.get_ref();
    u64::try_from(value)
        .ok()
        .filter(|&l| l > 0 && l <= MAX_UNITS)
        .ok_or_else(|| {
            let why = if value > 0 {
                "is more than every store counts exactly"
            } else {
                "lets nothing through"
            };
            (
                Some(limit.span()),
                format!(
                    "policy {name:?}: limit = {value} {why}: write a limit of 1 to {MAX_UNITS} \
                     (2^53 units a period)"
                ),
            )
        })
}

/// `quota` of policy `name` with its `burst` as written, if any: at least the limit.
fn with_burst(
    name: &str,
    quota: Quota,
    burst: Option<&Spanned<i64>>,
) -> Result<Quota, (Option<Range<usize>>, String)> {
    let Some(burst) = burst else {
        return Ok(quota);
    };
    let (value, limit) = (*burst.get_ref(), quota.limit());
    let Some(b) = u64::try_from(value).ok().filter(|&b| b >= limit) else {
        return Err((
            Some(burst.span()),
            format!(
                "policy {name:?}: burst = {value} is below the limit ({limit}), so a whole \
                 period's units could never pass at once: write a burst of at least {limit}, \
                 or leave it out (the limit)"
            ),
        ));
    };
    quota
        .with_burst(b)
        .map_err(|e| (Some(burst.span()), e.to_string()))
}

/// Why a quota does not suit its algorithm, at the number that does not fit: the burst
/// if the error says so, else the limit.
fn misfit(
    error: ConfigError,
    limit: &Spanned<i64>,
    burst: Option<&Spanned<i64>>,
) -> (Option<Range<usize>>, String) {
    let message = error.to_string();
    let at = match burst {
        Some(burst) if message.contains("with_burst") => burst.span(),
        _ => limit.span(),
    };
    (Some(at), message)
}

/// `limit` a window of `period = "calendar <unit>"`, in the section's zone (UTC if
/// unsaid).
fn calendar_quota(
    name: &str,
    section: &PolicySection,
    limit: u64,
    unit: &str,
) -> Result<Quota, (Option<Range<usize>>, String)> {
    let unit = CalendarUnit::named(unit).ok_or_else(|| {
        (
            Some(section.period.span()),
            format!(
                "policy {name:?}: period = {:?} is not a calendar period: write \"calendar \
                 minute\", \"calendar hour\", \"calendar day\", \"calendar week\", \"calendar \
                 month\" or \"calendar year\"",
                section.period.get_ref()
            ),
        )
    })?;
    let calendar = match &section.zone {
        None => Calendar::utc(unit),
        Some(zone) => Calendar::in_zone(unit, zone.get_ref())
            .map_err(|e| (Some(zone.span()), format!("policy {name:?}: {e}")))?,
    };
    Quota::per_calendar(limit, calendar).map_err(|e| (Some(section.period.span()), e.to_string()))
}

/// `1s`, `30s`, `1m`, `1h`, `1d`, `250ms`: a whole number and a unit.
pub(super) fn parse_period(text: &str) -> Option<Duration> {
    let digits = text.trim().find(|c: char| !c.is_ascii_digit())?;
    let (number, unit) = text.trim().split_at(digits);
    let n: u64 = number.parse().ok()?;
    let seconds = match unit {
        "ms" => return Some(Duration::from_millis(n)),
        "s" => 1,
        "m" => 60,
        "h" => 3_600,
        "d" => 86_400,
        _ => return None,
    };
    n.checked_mul(seconds).map(Duration::from_secs)
}

/// Whether `value` can be an API key a request sends: a header's value has no
/// whitespace at its ends (HTTP trims it) and no control characters. The message never
/// repeats the value (API keys stay out of logs).
pub(super) fn api_key_value(value: &str) -> Result<(), &'static str> {
    if value.is_empty() {
        Err("an API key is empty here: write the key, like \"key:partner-key\"")
    } else if value.trim() != value {
        Err(
            "this API key starts or ends with whitespace, which a request's header never \
             does (HTTP trims it), so it would never match: remove the spaces",
        )
    } else if value.chars().any(char::is_control) {
        Err("this API key has a control character, which no header carries: remove it")
    } else {
        Ok(())
    }
}

/// `message` with the text of every `string "..."` it quotes (serde's words for a value
/// of the wrong type, which may be an API key) left out.
pub(super) fn redact_strings(message: &str) -> String {
    let mut out = String::new();
    let mut rest = message;
    while let Some(i) = rest.find("string \"") {
        let (before, quoted) = rest.split_at(i + "string \"".len());
        out.push_str(before);
        out.push_str("…\"");
        let mut escaped = false;
        let end = quoted.char_indices().find(|&(_, c)| {
            let close = c == '"' && !escaped;
            escaped = c == '\\' && !escaped;
            close
        });
        rest = end.map_or("", |(j, _)| &quoted[j + 1..]);
    }
    out.push_str(rest);
    out
}

/// Where an error toml gives without a place comes from: the first line that, read on
/// its own, fails with the same `message` (a key is on one line), from its first
/// character.
pub(super) fn line_of(text: &str, message: &str) -> Option<Range<usize>> {
    let mut start = 0;
    for line in text.split_inclusive('\n') {
        let alone = toml::from_str::<toml::Table>(line);
        if alone.is_err_and(|e| e.message() == message) {
            let indent = line.len() - line.trim_start().len();
            return Some(start + indent..start + line.len());
        }
        start += line.len();
    }
    None
}

/// `message`, prefixed with `name:line:column:` of the start of `span`.
pub(super) fn locate(
    name: &str,
    text: &str,
    span: Option<Range<usize>>,
    message: &str,
) -> ConfigError {
    let Some(span) = span else {
        return ConfigError::new(format!("{name}: {message}"));
    };
    let before = text.get(..span.start).unwrap_or(text);
    let line = before.matches('\n').count() + 1;
    let column = before.len() - before.rfind('\n').map_or(0, |i| i + 1) + 1;
    ConfigError::new(format!("{name}:{line}:{column}: {message}"))
}
