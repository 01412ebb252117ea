//! `[[descriptors]]`: Envoy rate limit descriptors mapped to the file's policies, for a
//! rate limit service (tollway-server) that shares the layer's limits.
//!
//! A rule names a domain, the entries of a descriptor in order, and the policy that
//! limits it (or `unlimited`). An entry's value is exact, a pattern with `*`, or absent:
//! any value, each counted apart.
//!
//! ```toml
//! [[descriptors]]
//! domain = "edge"
//! entries = [{ key = "remote_address" }]      # every address its own count
//! policy = "anonymous"
//! key = "ip"                                  # counted as the layer counts peers: ip:<address>
//!
//! [[descriptors]]
//! domain = "edge"
//! entries = [{ key = "path", value = "/api/v1/checkout" }, { key = "remote_address" }]
//! policy = "checkout"
//!
//! [[descriptors]]
//! domain = "edge"
//! entries = [{ key = "client", value = "internal-*" }]
//! unlimited = true
//!
//! [[descriptors]]
//! domain = "llm"
//! entries = [{ key = "client" }]
//! policy = "tokens"
//! hits_entry = "tokens"    # the hits come in this entry (the proxy's x-max-tokens)
//! default_hits = 1_000     # without it, or not a number: 1,000; 0 counts as 1
//! max_hits = 4_096         # a descriptor's hits (or give-back) past it count as 4,096
//! shadow_mode = true       # decided and counted, never refused
//!
//! [[descriptors]]          # a partner: its own limit, in place of the address's
//! domain = "edge"
//! entries = [{ key = "client", value = "partner-*" }]
//! policy = "partner"
//! replaces = ["by_address"]   # the rule named so is not applied to such a request
//! ```
//!
//! A rule's `name` lets `replaces` name it: a request that matches a rule with
//! `replaces` skips the limits of the rules it names, as envoyproxy/ratelimit does. Key
//! such a rule on what the client cannot claim: the client name an authentication filter
//! writes (`client` above), never a key the client picks, or a made-up `partner-1` skips
//! the address limit.
//!
//! `min_hits` is the fewest hits a descriptor charges (0 then charges that many, never a
//! look). With `hits_entry` it is at least 1.

use std::collections::BTreeSet;

use tollway_core::{Algorithm, ConfigError, Policy};
use toml::Spanned;

use super::LimitsFile;
use super::schema::{DescriptorSection, EntrySection};

/// One `[[descriptors]]` rule, validated: what a rate limit service matches a request's
/// descriptors against (tollway-server does the matching).
///
/// A `[[buckets]]` rule is one too (see [`LimitsFile::buckets`]): its entries match a
/// bucket id's keys in any order.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct DescriptorRule {
    /// The domain it is for.
    pub domain: String,
    /// Its entries, in order: each a key and what its value must be.
    pub entries: Vec<(String, EntryValue)>,
    /// The policy that limits it; `None`: unlimited.
    pub policy: Option<Policy>,
    /// Where its keys are counted.
    pub key: DescriptorKey,
    /// The most hits one descriptor charges or gives back (`max_hits`): more count as
    /// this many. `None`: as many as Envoy sends.
    pub max_hits: Option<u64>,
    /// The fewest hits one descriptor charges (`min_hits`): fewer, 0 included, count as
    /// this many, so a reservation is never a look. `None`: 0 looks without charging.
    /// With `hits_entry`, at least 1.
    pub min_hits: Option<u64>,
    /// The entry a descriptor's hits come in, as text, and the hits when it is missing
    /// or not a whole number (`hits_entry`, `default_hits`). The entry is neither matched
    /// nor part of the key.
    pub hits_entry: Option<(String, u64)>,
    /// Decided and counted, never refused (`shadow_mode`).
    pub shadow: bool,
    /// Its name, for other rules' `replaces`.
    pub name: Option<String>,
    /// The names of the rules whose limits a request matching this one skips.
    pub replaces: Vec<String>,
}

/// What a descriptor entry's value must be.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum EntryValue {
    /// This value.
    Exact(String),
    /// A pattern of literal pieces between `*`s, each `*` any run of characters.
    Pattern(String),
    /// Any value, each counted apart.
    Any,
}

/// Where a descriptor rule's keys are counted.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum DescriptorKey {
    /// Its own: `rls:<domain>|<key>=<value>|...`.
    Own,
    /// `ip:<address>`, as the layer keys a peer: IPv4-mapped addresses as IPv4, IPv6
    /// grouped by this prefix (`key = "ip"`).
    Ip(u8),
    /// `<namespace>:<value>|<value>...` (`key = "<namespace>"`).
    Named(String),
}

impl LimitsFile {
    /// The file's `[[descriptors]]`, for a rate limit service, in the file's order.
    ///
    /// # Errors
    ///
    /// Never for a file that [`parse`](Self::parse) accepted: each rule is checked there.
    pub fn descriptors(&self) -> Result<Vec<DescriptorRule>, ConfigError> {
        let mut rules: Vec<DescriptorRule> = Vec::new();
        for section in &self.file.descriptors {
            let rule = self.descriptor_rule(section.get_ref())?;
            if rules
                .iter()
                .any(|r| r.domain == rule.domain && r.entries == rule.entries)
            {
                return Err(self.at(
                    Some(section.span()),
                    "another [[descriptors]] rule has this domain and these entries: keep one",
                ));
            }
            rules.push(rule);
        }
        // Names are unique, and `replaces` names one of them.
        let mut named = BTreeSet::new();
        for section in &self.file.descriptors {
            if let Some(name) = &section.get_ref().name
                && !named.insert(name.get_ref().as_str())
            {
                return Err(self.at(
                    Some(name.span()),
                    "another [[descriptors]] rule has this name: give each its own",
                ));
            }
        }
        for section in &self.file.descriptors {
            for replaced in &section.get_ref().replaces {
                if !named.contains(replaced.get_ref().as_str()) {
                    return Err(self.at(
                        Some(replaced.span()),
                        &format!(
                            "no [[descriptors]] rule is named {:?}: give the rule it replaces \
                             name = {:?}",
                            replaced.get_ref(),
                            replaced.get_ref()
                        ),
                    ));
                }
            }
        }
        Ok(rules)
    }

    /// The policies descriptors name, which therefore limit something.
    pub(super) fn descriptor_policies(&self) -> BTreeSet<&str> {
        self.file
            .descriptors
            .iter()
            .filter_map(|d| d.get_ref().policy.as_ref())
            .map(|p| p.get_ref().as_str())
            .collect()
    }

    fn descriptor_rule(&self, d: &DescriptorSection) -> Result<DescriptorRule, ConfigError> {
        let domain = self.rule_domain(&d.domain, "descriptor")?;
        let entries = self.rule_entries(&d.entries, "descriptor")?;
        let policy = self.rule_policy(&d.domain, d.policy.as_ref(), d.unlimited, "descriptor")?;
        if let Some(policy) = &policy {
            // A slot would never be given back, a delay never waited: Envoy only asks.
            if matches!(
                policy.algorithm(),
                Algorithm::Concurrency | Algorithm::LeakyBucketShaper
            ) {
                return Err(self.at(
                    d.policy.as_ref().map(Spanned::span),
                    &format!(
                        "policy {:?} is {}, which a rate limit service cannot apply: Envoy \
                         asks once and never says when a call ends, nor waits a delay; give \
                         the descriptor a policy of another algorithm",
                        policy.name(),
                        policy.algorithm().name()
                    ),
                ));
            }
        }
        let key = self.rule_key(d.key.as_ref(), &entries)?;
        let hits = |field: &Option<Spanned<i64>>, name: &str| -> Result<Option<u64>, ConfigError> {
            match field {
                None => Ok(None),
                Some(n) => u64::try_from(*n.get_ref())
                    .ok()
                    .filter(|&n| n >= 1)
                    .map(Some)
                    .ok_or_else(|| {
                        self.at(
                            Some(n.span()),
                            &format!("{name} is a number of hits: write 1 or more"),
                        )
                    }),
            }
        };
        let max_hits = hits(&d.max_hits, "max_hits")?;
        let mut min_hits = hits(&d.min_hits, "min_hits")?;
        if let (Some(min), Some(max), Some(span)) =
            (min_hits, max_hits, d.min_hits.as_ref().map(Spanned::span))
            && min > max
        {
            return Err(self.at(
                Some(span),
                &format!("min_hits is {min}, past max_hits {max}: write at most {max}"),
            ));
        }
        let default_hits = hits(&d.default_hits, "default_hits")?;
        let hits_entry = match (&d.hits_entry, default_hits) {
            (None, None) => None,
            (Some(entry), Some(default)) => {
                if entries.iter().any(|(k, _)| k == entry.get_ref()) {
                    return Err(self.at(
                        Some(entry.span()),
                        "hits_entry names one of the rule's entries: name the entry the hits \
                         come in, which the rule does not match",
                    ));
                }
                // A reservation is never a look.
                min_hits = Some(min_hits.unwrap_or(1));
                Some((entry.get_ref().clone(), default))
            }
            (Some(entry), None) => {
                return Err(self.at(
                    Some(entry.span()),
                    "hits_entry needs default_hits: the hits of a descriptor without the \
                     entry, or with a value that is not a number (write default_hits = 1_000)",
                ));
            }
            (None, Some(_)) => {
                return Err(self.at(
                    d.default_hits.as_ref().map(Spanned::span),
                    "default_hits is for a rule with hits_entry: name the entry the hits come \
                     in (hits_entry = \"tokens\"), or leave default_hits out",
                ));
            }
        };
        Ok(DescriptorRule {
            domain,
            entries,
            policy,
            key,
            max_hits,
            min_hits,
            hits_entry,
            shadow: d.shadow_mode,
            name: d.name.as_ref().map(|n| n.get_ref().clone()),
            replaces: d.replaces.iter().map(|r| r.get_ref().clone()).collect(),
        })
    }

    /// A rule's domain, which is not empty. `what` names the rule in messages:
    /// "descriptor" or "bucket".
    pub(super) fn rule_domain(
        &self,
        domain: &Spanned<String>,
        what: &str,
    ) -> Result<String, ConfigError> {
        if domain.get_ref().is_empty() {
            return Err(self.at(
                Some(domain.span()),
                &format!("a {what}'s domain is not empty"),
            ));
        }
        Ok(domain.get_ref().clone())
    }

    /// A rule's entries, in the file's order: at least one, each with a key.
    pub(super) fn rule_entries(
        &self,
        entries: &Spanned<Vec<Spanned<EntrySection>>>,
        what: &str,
    ) -> Result<Vec<(String, EntryValue)>, ConfigError> {
        if entries.get_ref().is_empty() {
            return Err(self.at(
                Some(entries.span()),
                &format!("a {what} has entries: write entries = [{{ key = \"remote_address\" }}]"),
            ));
        }
        let mut read = Vec::new();
        for entry in entries.get_ref() {
            let e = entry.get_ref();
            if e.key.get_ref().is_empty() {
                return Err(self.at(Some(e.key.span()), "an entry's key is not empty"));
            }
            let value = match &e.value {
                None => EntryValue::Any,
                Some(v) if v.get_ref().contains('*') => EntryValue::Pattern(v.get_ref().clone()),
                Some(v) => EntryValue::Exact(v.get_ref().clone()),
            };
            read.push((e.key.get_ref().clone(), value));
        }
        Ok(read)
    }

    /// The policy a rule names, or `None`: unlimited. One of the two is said.
    pub(super) fn rule_policy(
        &self,
        domain: &Spanned<String>,
        policy: Option<&Spanned<String>>,
        unlimited: bool,
        what: &str,
    ) -> Result<Option<Policy>, ConfigError> {
        match (policy, unlimited) {
            (Some(name), false) => Ok(Some(self.policy_named(name)?.clone())),
            (None, true) => Ok(None),
            (Some(name), true) => Err(self.at(
                Some(name.span()),
                &format!("a {what} is limited by a policy or unlimited, not both"),
            )),
            (None, false) => Err(self.at(
                Some(domain.span()),
                &format!("a {what} needs policy = \"<a [policies] name>\", or unlimited = true"),
            )),
        }
    }

    /// Where a rule's keys are counted: its own, the layer's peers (`"ip"`, for one
    /// entry without a value) or a namespace.
    pub(super) fn rule_key(
        &self,
        key: Option<&Spanned<String>>,
        entries: &[(String, EntryValue)],
    ) -> Result<DescriptorKey, ConfigError> {
        let Some(ns) = key else {
            return Ok(DescriptorKey::Own);
        };
        if ns.get_ref() == "ip" {
            if !matches!(entries, [(_, EntryValue::Any)]) {
                return Err(self.at(
                    Some(ns.span()),
                    "key = \"ip\" counts one address: give the rule one entry without \
                     a value, like entries = [{ key = \"remote_address\" }]",
                ));
            }
            return Ok(DescriptorKey::Ip(self.ipv6_prefix()));
        }
        let good = !ns.get_ref().is_empty()
            && ns.get_ref().len() <= 32
            && ns
                .get_ref()
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
        if !good {
            return Err(self.at(
                Some(ns.span()),
                "key is a namespace of letters, digits, '_' and '-' (at most 32): \
                 write key = \"ip\" to count as the layer counts peer addresses",
            ));
        }
        Ok(DescriptorKey::Named(ns.get_ref().clone()))
    }

    /// The summary's lines for the descriptors.
    pub(super) fn descriptor_summary(&self, out: &mut String) {
        use std::fmt::Write as _;
        for d in &self.file.descriptors {
            let d = d.get_ref();
            let what = d
                .policy
                .as_ref()
                .map_or("unlimited", |p| p.get_ref().as_str());
            let max_hits = d
                .max_hits
                .as_ref()
                .map_or(String::new(), |m| format!(", at most {} hits", m.get_ref()));
            let min_hits = d.min_hits.as_ref().map_or(String::new(), |m| {
                format!(", at least {} hits", m.get_ref())
            });
            let entry = d.hits_entry.as_ref().map_or(String::new(), |e| {
                let default = d.default_hits.as_ref().map_or(0, |n| *n.get_ref());
                format!(", hits from {} (else {default})", e.get_ref())
            });
            let shadow = if d.shadow_mode { ", in shadow" } else { "" };
            let name = d
                .name
                .as_ref()
                .map_or(String::new(), |n| format!(" {:?}", n.get_ref()));
            let replaces: Vec<&str> = d.replaces.iter().map(|r| r.get_ref().as_str()).collect();
            let replaces = if replaces.is_empty() {
                String::new()
            } else {
                format!(", replaces {replaces:?}")
            };
            // Writing to a String cannot fail.
            let _ = writeln!(
                out,
                "  descriptor{name}: {} ({}) -> {what}{entry}{min_hits}{max_hits}{shadow}{replaces}",
                d.domain.get_ref(),
                entries_text(d.entries.get_ref())
            );
        }
    }
}

/// A rule's entries as the summary shows them: `key=value, key=*`.
pub(super) fn entries_text(entries: &[Spanned<EntrySection>]) -> String {
    let shown: Vec<String> = entries
        .iter()
        .map(|e| {
            let e = e.get_ref();
            match &e.value {
                Some(v) => format!("{}={}", e.key.get_ref(), v.get_ref()),
                None => format!("{}=*", e.key.get_ref()),
            }
        })
        .collect();
    shown.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str = r#"
[layer]
default = "api"

[policies.api]
algorithm = "gcra"
limit = 10
period = "1s"

[policies.checkout]
algorithm = "gcra"
limit = 2
period = "1m"

[[descriptors]]
domain = "edge"
entries = [{ key = "remote_address" }]
policy = "api"
key = "ip"

[[descriptors]]
domain = "edge"
entries = [{ key = "path", value = "/api/v1/checkout" }, { key = "remote_address" }]
policy = "checkout"

[[descriptors]]
domain = "edge"
entries = [{ key = "path", value = "/api/*" }, { key = "remote_address" }]
unlimited = true
"#;

    #[test]
    fn the_rules_are_read_in_order_and_summarised() {
        let file = LimitsFile::parse("limits.toml", FILE).unwrap();
        let rules = file.descriptors().unwrap();
        assert_eq!(rules.len(), 3);
        assert_eq!(rules[0].key, DescriptorKey::Ip(64));
        assert_eq!(rules[0].policy.as_ref().map(Policy::name), Some("api"));
        assert_eq!(
            rules[2].entries,
            [
                ("path".to_owned(), EntryValue::Pattern("/api/*".to_owned())),
                ("remote_address".to_owned(), EntryValue::Any)
            ]
        );
        assert!(rules[2].policy.is_none());
        let summary = file.summary();
        assert!(
            summary.contains("  descriptor: edge (remote_address=*) -> api\n"),
            "{summary}"
        );
    }

    #[test]
    fn a_rule_that_cannot_work_is_refused_where_it_is() {
        let err = |text: &str| {
            LimitsFile::parse("limits.toml", text)
                .unwrap_err()
                .to_string()
        };
        let e = err(&FILE.replace("policy = \"checkout\"", "policy = \"nope\""));
        assert!(e.starts_with("limits.toml:24:10: "), "{e}");
        let e = err(&FILE.replace("unlimited = true", "unlimited = true\npolicy = \"api\""));
        assert!(e.contains("not both"), "{e}");
        let e = err(&FILE.replace("key = \"ip\"", "key = \"i p\""));
        assert!(e.starts_with("limits.toml:19:7: "), "{e}");
        let e = err(&FILE.replace("key = \"ip\"", "key = \"ip\"\nmax_hits = 0"));
        assert!(e.starts_with("limits.toml:20:12: "), "{e}");
        assert!(e.contains("write 1 or more"), "{e}");
        let capped = FILE.replace(
            "key = \"ip\"",
            "key = \"ip\"\nmax_hits = 7\nshadow_mode = true",
        );
        let capped = LimitsFile::parse("limits.toml", &capped).unwrap();
        // `replaces` names a rule's `name`; names are unique.
        let named = FILE.replace("key = \"ip\"", "key = \"ip\"\nname = \"by_address\"");
        let replacing = named.replace(
            "unlimited = true",
            "unlimited = true\nreplaces = [\"by_address\"]",
        );
        let rules = LimitsFile::parse("limits.toml", &replacing)
            .unwrap()
            .descriptors()
            .unwrap();
        assert_eq!(rules[0].name.as_deref(), Some("by_address"));
        assert_eq!(rules[2].replaces, ["by_address"]);
        let e = err(&named.replace(
            "unlimited = true",
            "unlimited = true\nreplaces = [\"nobody\"]",
        ));
        assert!(e.starts_with("limits.toml:31:13: "), "{e}");
        assert!(e.contains("name = \"nobody\""), "{e}");
        let twice = named.replace(
            "policy = \"checkout\"",
            "policy = \"checkout\"\nname = \"by_address\"",
        );
        assert!(err(&twice).contains("has this name"), "{}", err(&twice));
        let rule = &capped.descriptors().unwrap()[0];
        assert_eq!((rule.max_hits, rule.shadow), (Some(7), true));
        assert!(
            capped
                .summary()
                .contains("-> api, at most 7 hits, in shadow\n"),
            "{}",
            capped.summary()
        );
        let shaper = FILE.replace(
            "algorithm = \"gcra\"\nlimit = 2",
            "algorithm = \"leaky_bucket_shaper\"\nlimit = 2",
        );
        assert!(err(&shaper).contains("cannot apply"), "{}", err(&shaper));
        let twice = format!(
            "{FILE}\n[[descriptors]]\ndomain = \"edge\"\nentries = [{{ key = \"remote_address\" }}]\npolicy = \"api\"\n"
        );
        assert!(err(&twice).contains("keep one"));
        // The checkout policy is used by a descriptor alone: not "limits nothing".
        LimitsFile::parse("limits.toml", FILE).unwrap();
    }

    // A reserving rule: its hits come in an entry it does not match, with a default, and
    // never below 1; floors and caps are whole numbers in order, each error where it is.
    #[test]
    fn a_reserving_rule_reads_its_hits_entry_and_floor() {
        let err = |text: &str| {
            LimitsFile::parse("limits.toml", text)
                .unwrap_err()
                .to_string()
        };
        let with = |extra: &str| FILE.replace("key = \"ip\"", &format!("key = \"ip\"\n{extra}"));
        let file = LimitsFile::parse(
            "limits.toml",
            &with("hits_entry = \"tokens\"\ndefault_hits = 300\nmax_hits = 4_096"),
        )
        .unwrap();
        let rule = &file.descriptors().unwrap()[0];
        assert_eq!(rule.hits_entry, Some(("tokens".to_owned(), 300)));
        assert_eq!((rule.min_hits, rule.max_hits), (Some(1), Some(4_096)));
        let floored = LimitsFile::parse("limits.toml", &with("min_hits = 5")).unwrap();
        assert_eq!(floored.descriptors().unwrap()[0].min_hits, Some(5));
        for (extra, said) in [
            ("min_hits = 0", "write 1 or more"),
            ("min_hits = 9\nmax_hits = 3", "past max_hits 3"),
            ("hits_entry = \"tokens\"", "needs default_hits"),
            ("default_hits = 10", "for a rule with hits_entry"),
            (
                "hits_entry = \"remote_address\"\ndefault_hits = 1",
                "one of the rule's entries",
            ),
        ] {
            let e = err(&with(extra));
            assert!(e.starts_with("limits.toml:20:"), "{extra}: {e}");
            assert!(e.contains(said), "{extra}: {e}");
        }
    }
}
