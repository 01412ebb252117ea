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

use tollway_core::{Algorithm, ConfigError, Policy};
use toml::Spanned;

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
    namespace: Namespace,
    /// Its precedence, lower first, entry by entry: made once, compared per request.
    rank: Vec<u8>,
}

/// Where a rule's keys are counted.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Namespace {
    /// `rls:<domain>|<key>=<value>|...`, each part escaped.
    Own,
    /// `ip:<address>`, as the layer keys a peer: IPv4-mapped addresses as IPv4, IPv6
    /// grouped by this prefix.
    Ip(u8),
    /// `<namespace>:<value>|<value>...`, each value escaped.
    Named(String),
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
            .min_by_key(|r| &r.rank)?;
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

    /// The key a descriptor of `entries` in `domain` is counted under. Each part is
    /// escaped, so that no value can pass for another part: `|`, `=` and `%` are
    /// written `%7C`, `%3D` and `%25`.
    fn key(&self, domain: &str, entries: &[(&str, &str)]) -> Key {
        let mut value = String::new();
        match &self.namespace {
            Namespace::Ip(prefix) => {
                // One entry: the rule is checked so.
                let raw = entries.first().map_or("", |(_, v)| *v);
                match raw.parse::<std::net::IpAddr>() {
                    Ok(address) => Key::ip(address, *prefix),
                    Err(_) => {
                        escape(&mut value, raw);
                        Key::new("ip", value)
                    }
                }
            }
            Namespace::Named(namespace) => {
                for (i, (_, v)) in entries.iter().enumerate() {
                    if i > 0 {
                        value.push('|');
                    }
                    escape(&mut value, v);
                }
                Key::new(namespace, value)
            }
            Namespace::Own => {
                escape(&mut value, domain);
                for (k, v) in entries {
                    value.push('|');
                    escape(&mut value, k);
                    value.push('=');
                    escape(&mut value, v);
                }
                Key::new(NAMESPACE, value)
            }
        }
    }
}

/// Appends `part` to `out` with `%`, `|` and `=` escaped.
fn escape(out: &mut String, part: &str) {
    for c in part.chars() {
        match c {
            '%' => out.push_str("%25"),
            '|' => out.push_str("%7C"),
            '=' => out.push_str("%3D"),
            c => out.push(c),
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
        let namespace = match &d.key {
            None => Namespace::Own,
            Some(ns) if ns.get_ref() == "ip" => {
                let single_any = d.entries.get_ref().len() == 1
                    && d.entries.get_ref()[0].get_ref().value.is_none();
                if !single_any {
                    return Err(self.at(
                        Some(ns.span()),
                        "key = \"ip\" counts one address: give the rule one entry without \
                         a value, like entries = [{ key = \"remote_address\" }]",
                    ));
                }
                Namespace::Ip(self.ipv6_prefix())
            }
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
                Namespace::Named(ns.get_ref().clone())
            }
        };
        let rank = entries
            .iter()
            .map(|(_, value)| match value {
                Value::Exact(_) => 0,
                Value::Pattern(_) => 1,
                Value::Any => 2,
            })
            .collect();
        Ok(DescriptorRule {
            domain: domain.clone(),
            entries,
            policy,
            namespace,
            rank,
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

    // A value cannot pass for another entry, nor one value for two.
    #[test]
    fn values_are_escaped_so_that_no_two_descriptors_share_a_key() {
        let own = DescriptorRule {
            domain: "edge".to_owned(),
            entries: vec![("path".to_owned(), Value::Any)],
            policy: None,
            namespace: Namespace::Own,
            rank: vec![2],
        };
        let forged = own.key("edge", &[("path", "/x|remote_address=1.2.3.4")]);
        let two = DescriptorRule {
            entries: vec![
                ("path".to_owned(), Value::Any),
                ("remote_address".to_owned(), Value::Any),
            ],
            ..own.clone()
        };
        let real = two.key("edge", &[("path", "/x"), ("remote_address", "1.2.3.4")]);
        assert_ne!(forged, real);
        let named = DescriptorRule {
            namespace: Namespace::Named("t".to_owned()),
            ..two
        };
        assert_ne!(
            named.key("edge", &[("a", "a|b"), ("b", "c")]),
            named.key("edge", &[("a", "a"), ("b", "b|c")])
        );
        // As the layer keys a peer: IPv4-mapped as IPv4, IPv6 by its /64.
        let ip = DescriptorRule {
            namespace: Namespace::Ip(64),
            ..own
        };
        assert_eq!(
            ip.key("edge", &[("remote_address", "::ffff:198.51.100.1")])
                .as_bytes(),
            b"ip:198.51.100.1"
        );
        assert_eq!(
            ip.key("edge", &[("remote_address", "2001:db8:1:2::7")])
                .as_bytes(),
            b"ip:2001:db8:1:2::/64"
        );
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
}
