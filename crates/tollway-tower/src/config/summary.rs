//! What a limits file says, a line each (`tollway check`), and what it lets a client do
//! that it may not mean to (its warnings).

use std::fmt::Write as _;

use tollway_core::{Algorithm, MAX_UNITS};

use super::file::LimitsFile;
use crate::shed::{self};

impl LimitsFile {
    /// What the file lets a client do that it may not mean to, a sentence each, at its
    /// line and column: what `tollway check` prints as warnings. The file is valid
    /// either way.
    ///
    /// Today: a cost read from a request header that nothing says the gateway writes.
    /// A client can send any header, so it chooses its own cost, between `min` and
    /// `max`.
    ///
    /// # Examples
    ///
    /// ```
    /// use tollway_tower::config::LimitsFile;
    ///
    /// let text = r#"
    /// [layer]
    /// default = "tokens"
    ///
    /// [policies.tokens]
    /// algorithm = "token_bucket"
    /// limit = 20_000
    /// period = "1m"
    /// cost = { header = "x-max-tokens", default = 1_000, max = 4_096 }
    /// "#;
    /// let file = LimitsFile::parse("limits.toml", text)?;
    /// let warnings = file.warnings();
    /// assert_eq!(warnings.len(), 1);
    /// assert!(warnings[0].starts_with("limits.toml:9:19: "), "{}", warnings[0]);
    /// assert!(warnings[0].contains("written_by = \"gateway\""), "{}", warnings[0]);
    ///
    /// let file = LimitsFile::parse("limits.toml", &text.replace("max = 4_096", "max = 4_096, written_by = \"gateway\""))?;
    /// assert!(file.warnings().is_empty());
    /// # Ok::<(), tollway_core::ConfigError>(())
    /// ```
    #[must_use]
    pub fn warnings(&self) -> Vec<String> {
        let mut warnings = Vec::new();
        for (name, policy) in &self.file.policies {
            let Some(cost) = &policy.get_ref().cost else {
                continue;
            };
            let cost = cost.get_ref();
            if cost.written_by.is_some() {
                continue;
            }
            let header = cost.header.get_ref();
            let (min, max) = self
                .cost_bounds(name, cost)
                .map_or((1, MAX_UNITS), |b| (b.min, b.max));
            let max = if max == MAX_UNITS {
                "none, so up to the policy's capacity".to_owned()
            } else {
                max.to_string()
            };
            warnings.push(
                self.at(
                    Some(cost.header.span()),
                    &format!(
                        "policy {name:?} costs what request header {header} says, and any \
                         client can send it: a client picks its own cost between min = {min} \
                         and max = {max}. If a layer before tollway writes the header (as \
                         examples/llm_gateway.rs does from the body), say so: written_by = \
                         \"gateway\"; to take the client's number knowingly, written_by = \
                         \"client\""
                    ),
                )
                .to_string(),
            );
        }
        warnings
    }

    /// The limits the file describes, a line each: what `tollway check` prints.
    #[must_use]
    pub fn summary(&self) -> String {
        let mut out = String::new();
        let file = &self.file;
        // Writing to a String cannot fail.
        let _ = writeln!(out, "{}: valid", self.name);
        for (name, policy) in &self.policies {
            let q = policy.quota();
            let quota = if policy.algorithm() == Algorithm::Concurrency {
                format!(
                    "{} at once, a slot living {:?} unrenewed",
                    q.limit(),
                    q.period()
                )
            } else if let Some(calendar) = q.calendar() {
                format!("{} a {calendar}", q.limit())
            } else {
                format!("{} per {:?}, burst {}", q.limit(), q.period(), q.burst())
            };
            let _ = write!(
                out,
                "  policy {name}: {} of {quota}{}{}",
                policy.algorithm().name(),
                if *name == *file.layer.default.get_ref() {
                    " (default)"
                } else {
                    ""
                },
                if file.policies[name].get_ref().shadow {
                    " (shadow)"
                } else {
                    ""
                },
            );
            let section = file.policies[name].get_ref();
            if let Some(cost) = &section.cost {
                let cost = cost.get_ref();
                // Checked when the file was read.
                let bounds = self.cost_bounds(name, cost).ok();
                let (min, max, default) =
                    bounds.map_or((1, MAX_UNITS, 1), |b| (b.min, b.max, b.default));
                let max = if max == MAX_UNITS {
                    "none".to_owned()
                } else {
                    max.to_string()
                };
                let by = cost.written_by.as_ref().map_or("unsaid", |b| b.get_ref());
                let _ = write!(
                    out,
                    " (cost: {}, default {default}, min {min}, max {max}, written by {by})",
                    cost.header.get_ref()
                );
            }
            if let Some(settle) = &section.settle {
                let settle = settle.get_ref();
                let header = settle
                    .header
                    .as_ref()
                    .map_or("the handler's Usage", |h| h.get_ref());
                let rule = settle.unsettled.as_ref().map_or("keep", |r| r.get_ref());
                let _ = write!(out, " (settled: {header}, unsettled {rule})");
            }
            let _ = writeln!(out);
        }
        for (key, tier) in &file.tiers {
            let key = redact(key.get_ref());
            let _ = writeln!(out, "  tier: key {key} -> {}", tier.get_ref());
        }
        for (key, plan) in &file.plans {
            let (key, plan) = (redact(key.get_ref()), plan.get_ref());
            let burst = plan
                .burst
                .as_ref()
                .map_or(String::new(), |b| format!(", burst {}", b.get_ref()));
            let _ = writeln!(
                out,
                "  plan: key {key} -> {} at {}{burst}",
                plan.tier.get_ref(),
                plan.limit.get_ref()
            );
        }
        for route in &file.routes {
            let r = route.get_ref();
            let method = r.method.as_ref().map_or("*", |m| m.get_ref().as_str());
            let target = r
                .path
                .as_ref()
                .or(r.grpc_method.as_ref())
                .map_or("", |p| p.get_ref().as_str());
            let _ = writeln!(out, "  route: {method} {target} -> {}", r.policy.get_ref());
        }
        let lists = &file.lists;
        for (what, entries) in [
            ("allow network", &lists.allow_networks),
            ("deny network", &lists.deny_networks),
            ("allow key", &lists.allow_keys),
            ("deny key", &lists.deny_keys),
        ] {
            for entry in entries {
                let entry = entry.get_ref();
                let shown = match entry.strip_prefix("key:") {
                    Some(key) => format!("key:{}", redact(key)),
                    None => entry.clone(),
                };
                let _ = writeln!(out, "  {what}: {shown}");
            }
        }
        self.descriptor_summary(&mut out);
        self.bucket_summary(&mut out);
        if let Some(shed) = &file.shed {
            let shed = shed.get_ref();
            let floor = shed.floor.as_ref().map_or(shed::FLOOR, |f| *f.get_ref());
            let ceiling = shed
                .ceiling
                .as_ref()
                .map_or(shed::CEILING, |c| *c.get_ref());
            let tolerance = shed.tolerance.as_ref().map_or(1.5, |t| *t.get_ref());
            let window = shed.window.as_ref().map_or("1s", |w| w.get_ref());
            let part = shed
                .per_address
                .as_ref()
                .map_or(shed::PER_ADDRESS, |p| *p.get_ref());
            let _ = writeln!(
                out,
                "  shed: calls in flight between {floor} and {ceiling}, latency tolerance \
                 {tolerance}, window {window}, {part} of a share per address{}",
                if shed.shadow { " (shadow)" } else { "" }
            );
            let mut left = 1.0;
            for priority in &shed.priorities {
                let p = priority.get_ref();
                let matches: Vec<String> = p
                    .routes
                    .iter()
                    .map(|r| r.get_ref().clone())
                    .chain(
                        p.headers
                            .iter()
                            .filter_map(|h| h.get_ref().as_table())
                            .flatten()
                            .map(|(name, values)| {
                                let n = values.as_array().map_or(0, Vec::len);
                                format!("header {name} in {n} values")
                            }),
                    )
                    .chain(
                        p.headers_present
                            .iter()
                            .map(|h| format!("header {} present (claimable)", h.get_ref())),
                    )
                    .chain(p.tiers.iter().map(|t| format!("tier {}", t.get_ref())))
                    .collect();
                left -= p.share.get_ref();
                let _ = writeln!(
                    out,
                    "  shed priority {}: share {} ({})",
                    p.name.get_ref(),
                    p.share.get_ref(),
                    matches.join(", ")
                );
            }
            let _ = writeln!(
                out,
                "  shed priority {}: share {} (the rest)",
                shed::OTHER,
                (f64::max(left, 0.0) * 1_000.0).round() / 1_000.0
            );
        }
        out
    }
}

/// An API key as `tollway check` shows it: its first characters (at most 3, a quarter
/// of it) and an ellipsis, so that a CI log holds no key.
pub(super) fn redact(key: &str) -> String {
    let shown: String = key.chars().take(3.min(key.chars().count() / 4)).collect();
    format!("\"{shown}…\"")
}
