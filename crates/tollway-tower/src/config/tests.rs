//! The file's checks, each error at its line and column.

use std::time::Duration;

use http::Request;

use super::LimitsFile;
use super::file::parse_period;
use crate::key::{Key, KeyExtractor};

/// A valid file with `extra` appended, or `policy` in place of the one policy's body.
pub(super) fn file(policy: &str, extra: &str) -> String {
    format!("[layer]\ndefault = \"api\"\n\n[policies.api]\n{policy}\n{extra}")
}

pub(super) const API: &str = "algorithm = \"gcra\"\nlimit = 10\nperiod = \"1s\"";

/// The error `text` gets, which must start with `limits.toml:line:column:`.
pub(super) fn error(text: &str, line: usize, column: usize) -> String {
    let err = LimitsFile::parse("limits.toml", text)
        .unwrap_err()
        .to_string();
    let at = format!("limits.toml:{line}:{column}: ");
    assert!(err.starts_with(&at), "{err:?} is not at {at:?}\n{text}");
    err
}

#[test]
fn a_valid_file_describes_its_limits() {
    let text = file(
        API,
        "\n[policies.export]\nalgorithm = \"fixed_window\"\nlimit = 2\nperiod = \"1h\"\n\n[[routes]]\ngrpc_method = \"/demo.Catalog/Export\"\npolicy = \"export\"\n",
    );
    let limits = LimitsFile::parse("limits.toml", &text).unwrap();
    let summary = limits.summary();
    assert!(
        summary.contains("policy api: gcra of 10 per 1s, burst 10 (default)"),
        "{summary}"
    );
    assert!(
        summary.contains("route: * /demo.Catalog/Export -> export"),
        "{summary}"
    );
}

#[test]
fn a_quota_of_zero_is_refused_at_its_limit() {
    let err = error(
        &file("algorithm = \"gcra\"\nlimit = 0\nperiod = \"1s\"", ""),
        6,
        9,
    );
    assert!(err.contains("write a limit of 1"), "{err}");
}

#[test]
fn an_unknown_algorithm_lists_the_known_ones() {
    let err = error(
        &file("algorithm = \"leaky\"\nlimit = 1\nperiod = \"1s\"", ""),
        5,
        13,
    );
    assert!(err.contains("\"token_bucket\""), "{err}");
}

#[test]
fn a_route_naming_an_unknown_policy_says_which_exist() {
    let text = file(API, "\n[[routes]]\npath = \"/x\"\npolicy = \"nope\"\n");
    let err = error(&text, 11, 10);
    assert!(
        err.contains("no policy is named \"nope\"") && err.contains("[\"api\"]"),
        "{err}"
    );
}

#[test]
fn a_network_that_does_not_parse_says_how_to_write_one() {
    let text = file(
        API,
        "\n[lists]\nallow_networks = [\"10.0.0.0/8\", \"10.0.0.0/33\"]\n",
    );
    let err = error(&text, 10, 33);
    assert!(err.contains("10.0.0.0/8"), "{err}");
}

#[test]
fn a_burst_below_the_limit_is_refused_at_the_burst() {
    let text = file(
        "algorithm = \"token_bucket\"\nlimit = 10\nperiod = \"1s\"\nburst = 5",
        "",
    );
    let err = error(&text, 8, 9);
    assert!(err.contains("at least 10"), "{err}");
}

#[test]
fn a_period_that_is_not_one_says_how_to_write_one() {
    let err = error(
        &file("algorithm = \"gcra\"\nlimit = 1\nperiod = \"soon\"", ""),
        7,
        10,
    );
    assert!(err.contains("\"1m\""), "{err}");
}

#[test]
fn an_unknown_field_is_refused_where_it_is() {
    let err = error(&file(API, "limt = 3\n"), 8, 1);
    assert!(err.contains("limt"), "{err}");
}

#[test]
fn a_route_may_not_share_a_policy_with_the_default() {
    let text = file(API, "\n[[routes]]\npath = \"/x\"\npolicy = \"api\"\n");
    let err = error(&text, 11, 10);
    assert!(err.contains("a policy of its own"), "{err}");
}

#[test]
fn a_choice_that_is_not_one_lists_the_choices() {
    let text = "[layer]\ndefault = \"api\"\nheaders = \"fancy\"\n\n[policies.api]\nalgorithm = \"gcra\"\nlimit = 1\nperiod = \"1s\"\n";
    let err = error(text, 3, 11);
    assert!(
        err.contains("[\"legacy\", \"ietf\", \"both\", \"none\"]"),
        "{err}"
    );
}

#[test]
fn store_settings_are_checked_before_start() {
    let store = |settings: &str| format!("[store]\n{settings}\n\n{}", file(API, ""));
    let err = error(
        &store("kind = \"redis\"\nurl = \"redis://127.0.0.1\"\ntimeout_ms = 0"),
        1,
        1,
    );
    assert!(err.contains("timeout"), "{err}");
    let err = error(
        &store("kind = \"redis\"\nurl = \"redis://127.0.0.1\"\nbreaker = { treshold = 3 }"),
        4,
        11,
    );
    assert!(err.contains("cool_down_ms = 250"), "{err}");
    let err = error(&store("max_keys = 0"), 2, 12);
    assert!(err.contains("max_keys"), "{err}");
}

#[test]
fn leases_are_for_a_redis_store_and_checked_before_start() {
    let store = |settings: &str| format!("[store]\n{settings}\n\n{}", file(API, ""));
    let err = error(&store("leases = true"), 2, 10);
    assert!(err.contains("kind = \"redis\""), "{err}");
    let redis = "kind = \"redis\"\nurl = \"redis://127.0.0.1\"";
    let err = error(
        &store(&format!("{redis}\nleases = {{ max_share = 2.0 }}")),
        4,
        10,
    );
    assert!(err.contains("max_share"), "{err}");
    let err = error(
        &store(&format!("{redis}\nleases = {{ horizon = 5 }}")),
        4,
        10,
    );
    assert!(err.contains("horizon_ms"), "{err}");
    let good = store(&format!(
        "{redis}\nleases = {{ horizon_ms = 100, min_units = 4, max_share = 0.2 }}"
    ));
    assert!(LimitsFile::parse("limits.toml", &good).is_ok());
}

#[test]
fn a_listed_api_key_is_seen_even_outside_the_tiers() {
    let text = format!(
        "[key]\napi_key = {{ header = \"x-api-key\" }}\n\n{}",
        file(API, "\n[lists]\ndeny_keys = [\"key:stolen\"]\n")
    );
    let limits = LimitsFile::parse("limits.toml", &text).unwrap();
    let request = Request::get("/")
        .header("x-api-key", "stolen")
        .body(())
        .unwrap();
    let key = KeyExtractor::<()>::extract(&limits.key().unwrap(), &request);
    assert_eq!(key, Some(Key::new("key", "stolen")));
    let unknown = Request::get("/")
        .header("x-api-key", "made-up")
        .body(())
        .unwrap();
    // Not known, and no peer address in this request: no key.
    assert_eq!(
        KeyExtractor::<()>::extract(&limits.key().unwrap(), &unknown),
        None
    );
}

#[test]
fn hops_counted_through_a_cdn_are_read_from_the_file() {
    let text = format!(
        "[key]\nclient_ip = {{ header = \"x-forwarded-for\", trusted_proxies = \
         [\"10.0.0.0/8\"], trusted_hops = 2, hops_through = [\"203.0.113.0/24\"] }}\n\n{}",
        file(API, "")
    );
    let limits = LimitsFile::parse("limits.toml", &text).unwrap();
    let mut direct = Request::get("/")
        .header("x-forwarded-for", "6.6.6.6, 198.51.100.7")
        .body(())
        .unwrap();
    let balancer: std::net::SocketAddr = "10.0.0.5:40000".parse().unwrap();
    direct.extensions_mut().insert(balancer);
    let key = KeyExtractor::<()>::extract(&limits.key().unwrap(), &direct);
    assert_eq!(key, Some(Key::new("ip", "198.51.100.7")));
    let bad = text.replace("203.0.113.0/24", "203.0.113.0/33");
    assert!(LimitsFile::parse("limits.toml", &bad).is_err());
}

#[test]
fn periods_are_a_number_and_a_unit() {
    assert_eq!(parse_period("250ms"), Some(Duration::from_millis(250)));
    assert_eq!(parse_period("1m"), Some(Duration::from_secs(60)));
    assert_eq!(parse_period("2d"), Some(Duration::from_secs(172_800)));
    assert_eq!(parse_period("m"), None);
    assert_eq!(parse_period("10"), None);
}
