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
//! entries = [{ key = "api_key", value = "internal-*" }]
//! unlimited = true
//! ```

use std::collections::BTreeSet;
use std::fmt;

use tollway_core::{ConfigError, Policy};

use super::LimitsFile;
use super::schema::DescriptorSection;
use crate::key::Key;

/// The namespace of a descriptor's key unless its rule names one.
const NAMESPACE: &str = "rls";

/// A file's descriptor rules, ready to match requests' descriptors.
#[derive(Clone, Debug, Default)]
pub struct Descriptors {
    rules: Vec<DescriptorRule>,
}

/// One `[[descriptors]]` rule.
#[derive(Clone)]
pub struct DescriptorRule {
    domain: String,
    entries: Vec<(String, Value)>,
    /// `None`: unlimited.
    policy: Option<Policy>,
    namespace: Option<String>,
}

/// What an entry's value must be.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Value {
    Exact(String),
    /// A pattern of literal pieces between `*`s.
    Pattern(String),
    Any,
}

/// What a descriptor matched: how to limit it, and under which key.
#[derive(Debug)]
pub struct Matched<'r> {
    /// The policy, or `None` for an unlimited descriptor.
    pub policy: Option<&'r Policy>,
    /// The key its counts are kept under.
    pub key: Key,
}

impl Descriptors {
    /// The rule that limits a descriptor of `entries` (keys and values, in order) in
    /// `domain`, and its key; `None` when no rule does.
    ///
    /// Rules of the same length and keys compete entry by entry: an exact value before a
    /// pattern before any value; among equals, the first in the file.
    #[must_use]
    pub fn find(&self, domain: &str, entries: &[(&str, &str)]) -> Option<Matched<'_>> {
        let rule = self
            .rules
            .iter()
            .filter(|r| r.domain == domain && r.fits(entries))
            .min_by_key(|r| r.rank())?;
        Some(Matched {
            policy: rule.policy.as_ref(),
            key: rule.key(domain, entries),
        })
    }

    /// How many rules there are.
    #[must_use]
    pub fn len(&self) -> usize {
        self.rules.len()
    }

    /// Whether there are none.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.rules.is_empty()
    }
}

impl DescriptorRule {
    fn fits(&self, entries: &[(&str, &str)]) -> bool {
        self.entries.len() == entries.len()
            && self
                .entries
                .iter()
                .zip(entries)
                .all(|((key, value), (k, v))| key == k && value.fits(v))
    }

    /// Its precedence: lower first, entry by entry.
    fn rank(&self) -> Vec<u8> {
        self.entries
            .iter()
            .map(|(_, value)| match value {
                Value::Exact(_) => 0,
                Value::Pattern(_) => 1,
                Value::Any => 2,
            })
            .collect()
    }

    /// The key a descriptor of `entries` in `domain` is counted under.
    fn key(&self, domain: &str, entries: &[(&str, &str)]) -> Key {
        let mut value = String::new();
        match &self.namespace {
            // A named namespace holds the values alone: `ip:203.0.113.9`.
            Some(namespace) => {
                for (i, (_, v)) in entries.iter().enumerate() {
                    if i > 0 {
                        value.push('|');
                    }
                    value.push_str(v);
                }
                Key::new(namespace, value)
            }
            None => {
                value.push_str(domain);
                for (k, v) in entries {
                    value.push('|');
                    value.push_str(k);
                    value.push('=');
                    value.push_str(v);
                }
                Key::new(NAMESPACE, value)
            }
        }
    }
}

impl Value {
    fn fits(&self, value: &str) -> bool {
        match self {
            Value::Exact(exact) => exact == value,
            Value::Any => true,
            Value::Pattern(pattern) => glob(pattern, value),
        }
    }
}

/// Whether `value` fits `pattern`, where `*` stands for any run of characters.
fn glob(pattern: &str, value: &str) -> bool {
    let mut pieces = pattern.split('*');
    let first = pieces.next().unwrap_or("");
    let Some(mut rest) = value.strip_prefix(first) else {
        return false;
    };
    let pieces: Vec<&str> = pieces.collect();
    let Some((last, middle)) = pieces.split_last() else {
        return rest.is_empty();
    };
    for piece in middle {
        match rest.find(piece) {
            Some(at) => rest = &rest[at + piece.len()..],
            None => return false,
        }
    }
    rest.ends_with(last)
}

impl fmt::Debug for DescriptorRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DescriptorRule")
            .field("domain", &self.domain)
            .field("entries", &self.entries)
            .field("policy", &self.policy.as_ref().map(Policy::name))
            .finish_non_exhaustive()
    }
}

impl LimitsFile {
    /// The file's `[[descriptors]]`, for a rate limit service.
    ///
    /// # Errors
    ///
    /// Never for a file that [`parse`](Self::parse) accepted: each rule is checked there.
    pub fn descriptors(&self) -> Result<Descriptors, ConfigError> {
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
        Ok(Descriptors { rules })
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
        let domain = d.domain.get_ref();
        if domain.is_empty() {
            return Err(self.at(Some(d.domain.span()), "a descriptor's domain is not empty"));
        }
        if d.entries.get_ref().is_empty() {
            return Err(self.at(
                Some(d.entries.span()),
                "a descriptor has entries: write entries = [{ key = \"remote_address\" }]",
            ));
        }
        let mut entries = Vec::new();
        for entry in d.entries.get_ref() {
            let e = entry.get_ref();
            if e.key.get_ref().is_empty() {
                return Err(self.at(Some(e.key.span()), "an entry's key is not empty"));
            }
            let value = match &e.value {
                None => Value::Any,
                Some(v) if v.get_ref().contains('*') => Value::Pattern(v.get_ref().clone()),
                Some(v) => Value::Exact(v.get_ref().clone()),
            };
            entries.push((e.key.get_ref().clone(), value));
        }
        let policy = match (&d.policy, d.unlimited) {
            (Some(name), false) => Some(self.policy_named(name)?.clone()),
            (None, true) => None,
            (Some(name), true) => {
                return Err(self.at(
                    Some(name.span()),
                    "a descriptor is limited by a policy or unlimited, not both",
                ));
            }
            (None, false) => {
                return Err(self.at(
                    Some(d.domain.span()),
                    "a descriptor needs policy = \"<a [policies] name>\", or unlimited = true",
                ));
            }
        };
        let namespace = match &d.key {
            None => None,
            Some(ns) => {
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
                Some(ns.get_ref().clone())
            }
        };
        Ok(DescriptorRule {
            domain: domain.clone(),
            entries,
            policy,
            namespace,
        })
    }

    /// The summary's lines for the descriptors.
    pub(super) fn descriptor_summary(&self, out: &mut String) {
        use std::fmt::Write as _;
        for d in &self.file.descriptors {
            let d = d.get_ref();
            let entries: Vec<String> = d
                .entries
                .get_ref()
                .iter()
                .map(|e| {
                    let e = e.get_ref();
                    match &e.value {
                        Some(v) => format!("{}={}", e.key.get_ref(), v.get_ref()),
                        None => format!("{}=*", e.key.get_ref()),
                    }
                })
                .collect();
            let what = d
                .policy
                .as_ref()
                .map_or("unlimited", |p| p.get_ref().as_str());
            // Writing to a String cannot fail.
            let _ = writeln!(
                out,
                "  descriptor: {} ({}) -> {what}",
                d.domain.get_ref(),
                entries.join(", ")
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pattern_takes_any_run_of_characters_for_each_star() {
        assert!(glob("internal-*", "internal-7"));
        assert!(glob("internal-*", "internal-"));
        assert!(!glob("internal-*", "external-7"));
        assert!(glob("*.example.com", "api.example.com"));
        assert!(glob("a*b*c", "a-x-b-y-c"));
        assert!(!glob("a*b*c", "a-x-c"));
        assert!(glob("*", ""));
    }

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
    fn a_descriptor_finds_its_rule_and_its_key() {
        let file = LimitsFile::parse("limits.toml", FILE).unwrap();
        let rules = file.descriptors().unwrap();
        assert_eq!(rules.len(), 3);
        let peer = rules
            .find("edge", &[("remote_address", "203.0.113.9")])
            .unwrap();
        assert_eq!(peer.policy.map(Policy::name), Some("api"));
        assert_eq!(peer.key.as_bytes(), b"ip:203.0.113.9");
        // The exact path wins over the pattern; a path the pattern takes is unlimited.
        let entries = [("path", "/api/v1/checkout"), ("remote_address", "1.2.3.4")];
        let checkout = rules.find("edge", &entries).unwrap();
        assert_eq!(checkout.policy.map(Policy::name), Some("checkout"));
        assert_eq!(
            checkout.key.as_bytes(),
            b"rls:edge|path=/api/v1/checkout|remote_address=1.2.3.4"
        );
        let entries = [("path", "/api/v1/search"), ("remote_address", "1.2.3.4")];
        assert!(rules.find("edge", &entries).unwrap().policy.is_none());
        // Another domain, more entries, or another key: no rule.
        assert!(
            rules
                .find("internal", &[("remote_address", "1.2.3.4")])
                .is_none()
        );
        assert!(rules.find("edge", &[("path", "/")]).is_none());
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
        let twice = format!(
            "{FILE}\n[[descriptors]]\ndomain = \"edge\"\nentries = [{{ key = \"remote_address\" }}]\npolicy = \"api\"\n"
        );
        assert!(err(&twice).contains("keep one"));
        // The checkout policy is used by a descriptor alone: not "limits nothing".
        LimitsFile::parse("limits.toml", FILE).unwrap();
    }
}
