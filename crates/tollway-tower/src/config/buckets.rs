//! `[[buckets]]`: Envoy rate limit quota (RLQS) buckets mapped to the file's policies,
//! for a quota service (tollway-server) that shares the layer's limits.
//!
//! A bucket id is a map of keys to values. A rule names a domain, the entries a bucket
//! id has, and the policy that limits it (or `unlimited`). Entries match in any order,
//! and each key is written once. An entry's value is exact, a pattern with `*`, or
//! absent: any value, each counted apart. `key` counts as a descriptor's does.
//!
//! ```toml
//! [[buckets]]
//! domain = "edge"
//! entries = [{ key = "api_key" }, { key = "path", value = "/v1/*" }]
//! policy = "partners"
//!
//! [[buckets]]
//! domain = "edge"
//! entries = [{ key = "remote_address" }]      # every address its own bucket
//! policy = "anonymous"
//! key = "ip"                                  # counted as the layer counts peers: ip:<address>
//!
//! [[buckets]]
//! domain = "edge"
//! entries = [{ key = "api_key", value = "internal-*" }]
//! unlimited = true
//! ```
//!
//! The service divides a bucket's policy among the Envoys that ask, as token buckets.
//! So the policy is a token bucket, GCRA or a leaky bucket (the meter). Its limit and
//! burst fit in 32 bits, as Envoy's `tokens_per_fill` and `max_tokens` do. Its burst
//! times its period stays below 2^53 milliseconds. No descriptor names it: a
//! descriptor's policy counts each request, a bucket's does not.
//!
//! A descriptor's `max_hits`, `shadow_mode`, `name` and `replaces` mean nothing here:
//! the file is refused where one is written.

use std::collections::BTreeSet;

use tollway_core::{ConfigError, Policy};

use super::LimitsFile;
use super::descriptors::{DescriptorRule, entries_text};
use super::schema::BucketSection;

impl LimitsFile {
    /// The file's `[[buckets]]`, for a rate limit quota service, in the file's order.
    ///
    /// A bucket rule is a [`DescriptorRule`] whose entries match a bucket id's keys in
    /// any order. Its `max_hits` is `None`, `shadow` false, `name` `None` and
    /// `replaces` empty.
    ///
    /// # Errors
    ///
    /// Never for a file that [`parse`](Self::parse) accepted: each rule is checked there.
    pub fn buckets(&self) -> Result<Vec<DescriptorRule>, ConfigError> {
        let mut rules: Vec<DescriptorRule> = Vec::new();
        for section in &self.file.buckets {
            let rule = self.bucket_rule(section.get_ref())?;
            // Each rule's keys are distinct, so equal lengths and inclusion are equal sets.
            let same = |r: &DescriptorRule| {
                r.domain == rule.domain
                    && r.entries.len() == rule.entries.len()
                    && r.entries.iter().all(|e| rule.entries.contains(e))
            };
            if rules.iter().any(same) {
                return Err(self.at(
                    Some(section.span()),
                    "another [[buckets]] rule has this domain and these entries (in any \
                     order): keep one",
                ));
            }
            rules.push(rule);
        }
        Ok(rules)
    }

    /// The policies buckets name, which therefore limit something.
    pub(super) fn bucket_policies(&self) -> BTreeSet<&str> {
        self.file
            .buckets
            .iter()
            .filter_map(|b| b.get_ref().policy.as_ref())
            .map(|p| p.get_ref().as_str())
            .collect()
    }

    fn bucket_rule(&self, b: &BucketSection) -> Result<DescriptorRule, ConfigError> {
        let domain = self.rule_domain(&b.domain, "bucket")?;
        let entries = self.rule_entries(&b.entries, "bucket")?;
        let mut keys = BTreeSet::new();
        for entry in b.entries.get_ref() {
            let key = &entry.get_ref().key;
            if !keys.insert(key.get_ref().as_str()) {
                return Err(self.at(
                    Some(key.span()),
                    &format!(
                        "key {:?} is in this bucket's entries twice: a bucket id has each \
                         key once; keep one",
                        key.get_ref()
                    ),
                ));
            }
        }
        let policy = self.rule_policy(&b.domain, b.policy.as_ref(), b.unlimited, "bucket")?;
        if let (Some(policy), Some(name)) = (&policy, &b.policy) {
            self.bucket_policy(policy)
                .map_err(|message| self.at(Some(name.span()), &message))?;
        }
        let key = self.rule_key(b.key.as_ref(), &entries)?;
        Ok(DescriptorRule {
            domain,
            entries,
            policy,
            key,
            max_hits: None,
            min_hits: None,
            hits_entry: None,
            shadow: false,
            name: None,
            replaces: Vec::new(),
        })
    }

    /// Why `policy` cannot be divided among Envoys as token buckets, if it cannot.
    fn bucket_policy(&self, policy: &Policy) -> Result<(), String> {
        let name = policy.name();
        let quota = policy.quota();
        let most = u32::MAX;
        if quota.limit() > u64::from(most) {
            return Err(format!(
                "policy {name:?} admits {} a period, more than an Envoy token bucket adds \
                 at once (tokens_per_fill, at most {most}): use a shorter period with a \
                 proportionally smaller limit",
                quota.limit()
            ));
        }
        if quota.burst() > u64::from(most) {
            return Err(format!(
                "policy {name:?} has a burst of {}, more than an Envoy token bucket holds \
                 (max_tokens, at most {most}): give it burst = {most} or less",
                quota.burst()
            ));
        }
        if !quota.period_micros().is_multiple_of(1_000_000) {
            return Err(format!(
                "policy {name:?} has a period of {:?}: Envoy reads a token bucket's fill \
                 interval in whole seconds; give it a period of whole seconds",
                quota.period()
            ));
        }
        tollway_core::share::shareable(policy).map_err(|e| e.to_string())?;
        if self.descriptor_policies().contains(name) {
            return Err(format!(
                "policy {name:?} limits descriptors too: an RLQS bucket's policy is divided \
                 among Envoys and keeps no per-request counts; give buckets a policy of \
                 their own"
            ));
        }
        Ok(())
    }

    /// The summary's lines for the buckets.
    pub(super) fn bucket_summary(&self, out: &mut String) {
        use std::fmt::Write as _;
        for b in &self.file.buckets {
            let b = b.get_ref();
            let what = b
                .policy
                .as_ref()
                .map_or("unlimited", |p| p.get_ref().as_str());
            // Writing to a String cannot fail.
            let _ = writeln!(
                out,
                "  bucket: {} ({}) -> {what}",
                b.domain.get_ref(),
                entries_text(b.entries.get_ref())
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{DescriptorKey, EntryValue};

    const FILE: &str = r#"
[layer]
default = "api"

[policies.api]
algorithm = "gcra"
limit = 10
period = "1s"

[policies.quota]
algorithm = "token_bucket"
limit = 100
period = "1m"

[policies.metered]
algorithm = "leaky_bucket"
limit = 5
period = "1s"

[[buckets]]
domain = "edge"
entries = [{ key = "api_key" }, { key = "path", value = "/v1/*" }]
policy = "quota"

[[buckets]]
domain = "edge"
entries = [{ key = "remote_address" }]
policy = "metered"
key = "ip"

[[buckets]]
domain = "edge"
entries = [{ key = "api_key", value = "internal-*" }]
unlimited = true
"#;

    fn err(text: &str) -> String {
        LimitsFile::parse("limits.toml", text)
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn the_rules_are_read_in_order_and_summarised() {
        // quota and metered limit buckets alone: not "limits nothing".
        let file = LimitsFile::parse("limits.toml", FILE).unwrap();
        let rules = file.buckets().unwrap();
        assert_eq!(rules.len(), 3);
        assert_eq!(
            rules[0].entries,
            [
                ("api_key".to_owned(), EntryValue::Any),
                ("path".to_owned(), EntryValue::Pattern("/v1/*".to_owned()))
            ]
        );
        assert_eq!(rules[0].policy.as_ref().map(Policy::name), Some("quota"));
        assert_eq!(rules[0].key, DescriptorKey::Own);
        let rule = &rules[0];
        assert_eq!(
            (rule.max_hits, rule.shadow, &rule.name, rule.replaces.len()),
            (None, false, &None, 0)
        );
        assert_eq!(rules[1].key, DescriptorKey::Ip(64));
        assert!(rules[2].policy.is_none());
        assert!(file.descriptors().unwrap().is_empty());
        let summary = file.summary();
        for line in [
            "  bucket: edge (api_key=*, path=/v1/*) -> quota\n",
            "  bucket: edge (remote_address=*) -> metered\n",
            "  bucket: edge (api_key=internal-*) -> unlimited\n",
        ] {
            assert!(summary.contains(line), "{summary}");
        }
        // GCRA is a token bucket too, and another domain is another bucket.
        let gcra = FILE.replace("\"token_bucket\"", "\"gcra\"");
        let other = format!(
            "{gcra}\n[[buckets]]\ndomain = \"other\"\nentries = [{{ key = \"api_key\" }}]\npolicy = \"quota\"\n"
        );
        let rules = LimitsFile::parse("limits.toml", &other)
            .unwrap()
            .buckets()
            .unwrap();
        assert_eq!(rules[3].domain, "other");
    }

    #[test]
    fn a_rule_that_cannot_work_is_refused_where_it_is() {
        let e = err(&FILE.replace("policy = \"quota\"", "policy = \"nope\""));
        assert!(e.starts_with("limits.toml:23:10: "), "{e}");
        let e = err(&FILE.replace("unlimited = true", "unlimited = true\npolicy = \"api\""));
        assert!(e.contains("not both"), "{e}");
        let e = err(&FILE.replace("policy = \"quota\"", "policy = \"quota\"\nkey = \"ip\""));
        assert!(e.starts_with("limits.toml:24:7: "), "{e}");
        let e = err(&FILE.replace("entries = [{ key = \"remote_address\" }]", "entries = []"));
        assert!(e.starts_with("limits.toml:27:11: "), "{e}");
        // A bucket id has each key once.
        let e = err(&FILE.replace("key = \"path\"", "key = \"api_key\""));
        assert!(e.starts_with("limits.toml:22:41: "), "{e}");
        assert!(e.contains("twice"), "{e}");
        // The same entries in another order are the same bucket.
        let twice = format!(
            "{FILE}\n[[buckets]]\ndomain = \"edge\"\nentries = [{{ key = \"path\", value = \"/v1/*\" }}, {{ key = \"api_key\" }}]\npolicy = \"quota\"\n"
        );
        let e = err(&twice);
        assert!(e.starts_with("limits.toml:36:1: "), "{e}");
        assert!(e.contains("keep one"), "{e}");
    }

    #[test]
    fn a_descriptors_fields_are_refused_in_a_bucket() {
        for field in [
            "max_hits = 7",
            "shadow_mode = true",
            "name = \"n\"",
            "replaces = [\"n\"]",
        ] {
            let e = err(&FILE.replace("key = \"ip\"", &format!("key = \"ip\"\n{field}")));
            assert!(e.starts_with("limits.toml:30:1: "), "{e}");
            assert!(e.contains("unknown field"), "{e}");
        }
    }

    #[test]
    fn a_policy_envoys_cannot_share_as_token_buckets_is_refused() {
        for algorithm in [
            "fixed_window",
            "sliding_window_log",
            "sliding_window_counter",
            "leaky_bucket_shaper",
            "concurrency",
        ] {
            let e = err(&FILE.replace("\"token_bucket\"", &format!("{algorithm:?}")));
            assert!(e.starts_with("limits.toml:23:10: "), "{e}");
            assert!(
                e.contains("give it algorithm = \"token_bucket\", \"gcra\" or \"leaky_bucket\""),
                "{e}"
            );
        }
        let quota = |numbers: &str| {
            err(&FILE.replace(
                "algorithm = \"token_bucket\"\nlimit = 100\nperiod = \"1m\"",
                &format!("algorithm = \"gcra\"\n{numbers}"),
            ))
        };
        // Envoy's tokens_per_fill and max_tokens are 32 bits.
        let e = quota("limit = 5_000_000_000\nperiod = \"2h\"");
        assert!(e.starts_with("limits.toml:23:10: "), "{e}");
        assert!(e.contains("tokens_per_fill"), "{e}");
        let e = quota("limit = 10\nperiod = \"1s\"\nburst = 5_000_000_000");
        assert!(e.starts_with("limits.toml:24:10: "), "{e}");
        assert!(e.contains("max_tokens"), "{e}");
        // A burst of 200 million over a day of 86.4 million ms: 1.7 × 10^16, past 2^53.
        let e = quota("limit = 200_000_000\nperiod = \"1d\"");
        assert!(e.starts_with("limits.toml:23:10: "), "{e}");
        assert!(e.contains("2^53"), "{e}");
        // Envoy reads a fill interval in whole seconds.
        let e = quota("limit = 10\nperiod = \"1500ms\"");
        assert!(e.contains("whole seconds"), "{e}");
        // A descriptor's policy counts each request; a bucket's is divided.
        let shared = format!(
            "{FILE}\n[[descriptors]]\ndomain = \"edge\"\nentries = [{{ key = \"api_key\" }}]\npolicy = \"quota\"\n"
        );
        let e = err(&shared);
        assert!(e.starts_with("limits.toml:23:10: "), "{e}");
        assert!(e.contains("limits descriptors too"), "{e}");
    }
}
