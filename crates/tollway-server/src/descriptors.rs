//! Matching a request's descriptors against the file's `[[descriptors]]` rules: which
//! rule limits a descriptor, and under which key its counts are kept.

use tollway_core::Policy;
use tollway_tower::Key;
use tollway_tower::config::{DescriptorKey, DescriptorRule, EntryValue};

/// The namespace of a descriptor's key unless its rule names one.
const NAMESPACE: &str = "rls";

/// A file's descriptor rules, ready to match requests' descriptors.
#[derive(Clone, Debug, Default)]
pub(crate) struct Descriptors {
    rules: Vec<Ranked>,
}

/// A rule and its precedence, lower first, entry by entry: made once, compared per
/// request.
#[derive(Clone, Debug)]
struct Ranked {
    rule: DescriptorRule,
    rank: Vec<u8>,
}

/// What a descriptor matched: how to limit it, and under which key.
#[derive(Debug)]
pub(crate) struct Matched<'r> {
    /// The policy, or `None` for an unlimited descriptor.
    pub(crate) policy: Option<&'r Policy>,
    /// The key its counts are kept under.
    pub(crate) key: Key,
    /// The most hits it charges or gives back.
    pub(crate) max_hits: Option<u64>,
    /// The fewest hits it charges.
    pub(crate) min_hits: Option<u64>,
    /// The hits its rule's `hits_entry` says (the entry's number, or the rule's
    /// default); `None` for a rule without one.
    pub(crate) entry_hits: Option<u64>,
    /// Decided and counted, never refused.
    pub(crate) shadow: bool,
    /// Its rule's name, which another matched rule may replace.
    pub(crate) name: Option<&'r str>,
    /// The names of the rules whose limits this request skips.
    pub(crate) replaces: &'r [String],
}

impl Descriptors {
    /// The matcher of `rules`, in the file's order.
    pub(crate) fn new(rules: Vec<DescriptorRule>) -> Self {
        let rules = rules
            .into_iter()
            .map(|rule| Ranked {
                rank: rule
                    .entries
                    .iter()
                    .map(|(_, value)| match value {
                        EntryValue::Exact(_) => 0,
                        EntryValue::Pattern(_) => 1,
                        // Any, and a kind of value added later: after the known ones.
                        _ => 2,
                    })
                    .collect(),
                rule,
            })
            .collect();
        Descriptors { rules }
    }

    /// The rule that limits a descriptor of `entries` (keys and values, in order) in
    /// `domain`, and its key; `None` when no rule does.
    ///
    /// Rules of the same length and keys compete entry by entry: an exact value before a
    /// pattern before any value; among equals, the first in the file.
    pub(crate) fn find(&self, domain: &str, entries: &[(&str, &str)]) -> Option<Matched<'_>> {
        let (ranked, matched, entry_hits) = self
            .rules
            .iter()
            .filter(|r| r.rule.domain == domain)
            .filter_map(|r| {
                let (matched, hits) = as_matched(&r.rule, entries);
                fits(&r.rule, &matched).then_some((r, matched, hits))
            })
            .min_by(|a, b| a.0.rank.cmp(&b.0.rank))?;
        Some(Matched {
            policy: ranked.rule.policy.as_ref(),
            key: key(&ranked.rule, domain, &matched),
            max_hits: ranked.rule.max_hits,
            min_hits: ranked.rule.min_hits,
            entry_hits,
            shadow: ranked.rule.shadow,
            name: ranked.rule.name.as_deref(),
            replaces: &ranked.rule.replaces,
        })
    }

    /// The rule that limits an RLQS bucket whose id is `id` (keys and values, in any
    /// order) in `domain`, and its key; `None` when no rule does.
    ///
    /// A rule fits a bucket of exactly its keys, each value as the rule says; rules
    /// compete as for descriptors, entry by entry in each rule's order.
    pub(crate) fn find_bucket(
        &self,
        domain: &str,
        id: &std::collections::HashMap<String, String>,
    ) -> Option<Matched<'_>> {
        let in_order = |rule: &DescriptorRule| -> Option<Vec<(&str, &str)>> {
            if rule.entries.len() != id.len() {
                return None;
            }
            rule.entries
                .iter()
                .map(|(key, _)| {
                    id.get_key_value(key.as_str())
                        .map(|(k, v)| (k.as_str(), v.as_str()))
                })
                .collect()
        };
        let (ranked, entries) = self
            .rules
            .iter()
            .filter(|r| r.rule.domain == domain)
            .filter_map(|r| {
                let entries = in_order(&r.rule).filter(|e| fits(&r.rule, e))?;
                Some((r, entries))
            })
            .min_by(|a, b| a.0.rank.cmp(&b.0.rank))?;
        Some(Matched {
            policy: ranked.rule.policy.as_ref(),
            key: key(&ranked.rule, domain, &entries),
            max_hits: None,
            min_hits: None,
            entry_hits: None,
            shadow: false,
            name: None,
            replaces: &[],
        })
    }

    /// How many rules there are.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.rules.len()
    }
}

/// Whether a descriptor of `entries` is `rule`'s: the same keys in order, each value as
/// the rule says.
/// A descriptor's entry: its key and value.
type Pair<'e> = (&'e str, &'e str);

/// A descriptor's entries, as given or without one.
type Pairs<'e> = std::borrow::Cow<'e, [Pair<'e>]>;

/// `entries` as `rule` matches them: without the entry its hits come in, if it names
/// one, and the hits that entry says (the rule's default when it is missing or not a
/// whole number).
fn as_matched<'e>(rule: &DescriptorRule, entries: &'e [Pair<'e>]) -> (Pairs<'e>, Option<u64>) {
    let Some((entry, default)) = &rule.hits_entry else {
        return (std::borrow::Cow::Borrowed(entries), None);
    };
    match entries.iter().position(|(k, _)| k == entry) {
        None => (std::borrow::Cow::Borrowed(entries), Some(*default)),
        Some(at) => {
            let hits = entries[at].1.trim().parse::<u64>().unwrap_or(*default);
            let mut rest = entries.to_vec();
            rest.remove(at);
            (std::borrow::Cow::Owned(rest), Some(hits))
        }
    }
}

fn fits(rule: &DescriptorRule, entries: &[(&str, &str)]) -> bool {
    rule.entries.len() == entries.len()
        && rule
            .entries
            .iter()
            .zip(entries)
            .all(|((key, value), (k, v))| key == k && value_fits(value, v))
}

fn value_fits(wanted: &EntryValue, value: &str) -> bool {
    match wanted {
        EntryValue::Exact(exact) => exact == value,
        EntryValue::Pattern(pattern) => glob(pattern, value),
        _ => true,
    }
}

/// The key a descriptor of `entries` in `domain` is counted under by `rule`. Each part is
/// escaped, so that no value can pass for another part: `|`, `=` and `%` are written
/// `%7C`, `%3D` and `%25`.
fn key(rule: &DescriptorRule, domain: &str, entries: &[(&str, &str)]) -> Key {
    let mut value = String::new();
    match &rule.key {
        DescriptorKey::Ip(prefix) => {
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
        DescriptorKey::Named(namespace) => {
            for (i, (_, v)) in entries.iter().enumerate() {
                if i > 0 {
                    value.push('|');
                }
                escape(&mut value, v);
            }
            Key::new(namespace, value)
        }
        // Its own, and a kind of key added later: counted apart.
        _ => {
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

#[cfg(test)]
mod tests {
    use tollway_tower::config::LimitsFile;

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

[key]
ipv6_prefix = 64

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

[[descriptors]]
domain = "edge"
entries = [{ key = "a" }, { key = "b" }]
policy = "checkout"
key = "t"

[[descriptors]]
domain = "edge"
entries = [{ key = "path" }]
policy = "checkout"
"#;

    fn rules() -> Descriptors {
        let file = LimitsFile::parse("limits.toml", FILE).unwrap();
        Descriptors::new(file.descriptors().unwrap())
    }

    #[test]
    fn a_descriptor_finds_its_rule_and_its_key() {
        let rules = rules();
        assert_eq!(rules.len(), 5);
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
        assert!(rules.find("edge", &[("remote", "/")]).is_none());
    }

    // A value cannot pass for another entry, nor one value for two.
    #[test]
    fn values_are_escaped_so_that_no_two_descriptors_share_a_key() {
        let rules = rules();
        let key = |entries: &[(&str, &str)]| rules.find("edge", entries).unwrap().key;
        let forged = key(&[("path", "/api/v1/checkout|remote_address=1.2.3.4")]);
        let real = key(&[("path", "/api/v1/checkout"), ("remote_address", "1.2.3.4")]);
        assert_ne!(forged.as_bytes(), real.as_bytes());
        assert_ne!(
            key(&[("a", "a|b"), ("b", "c")]).as_bytes(),
            key(&[("a", "a"), ("b", "b|c")]).as_bytes()
        );
        // As the layer keys a peer: IPv4-mapped as IPv4, IPv6 by its /64.
        assert_eq!(
            key(&[("remote_address", "::ffff:198.51.100.1")]).as_bytes(),
            b"ip:198.51.100.1"
        );
        assert_eq!(
            key(&[("remote_address", "2001:db8:1:2::7")]).as_bytes(),
            b"ip:2001:db8:1:2::/64"
        );
    }
}
