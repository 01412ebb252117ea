//! What a file may say is what the layer matches: every entry that could never match a
//! request is refused where it is written, and `check`'s summary holds no API key.

use super::*;

use super::tests::{API, error};

/// A valid file with `extra` appended.
fn file(extra: &str) -> String {
    super::tests::file(API, extra)
}

const ROUTE: &str = "\n[policies.checkout]\nalgorithm = \"gcra\"\nlimit = 1\nperiod = \"1s\"\n\n[[routes]]\npath = \"/checkout\"\n";

/// `method = "post"` parsed as an extension method that no request has: refused, with
/// the spelling that matches. Upper-case extension methods stay accepted.
#[test]
fn a_lower_case_method_is_refused_with_its_upper_case() {
    let text = file(&format!(
        "{ROUTE}method = \"post\"\npolicy = \"checkout\"\n"
    ));
    let err = error(&text, 16, 10);
    assert!(err.contains("write method = \"POST\""), "{err}");
    let text = file(&format!(
        "{ROUTE}method = \"PURGE\"\npolicy = \"checkout\"\n"
    ));
    LimitsFile::parse("limits.toml", &text).unwrap();
}

/// A listed key is matched byte for byte: a wrong-case namespace, a space, a namespace
/// the file's keys never have, or an address not spelled as its key never match.
#[test]
fn listed_keys_that_could_never_match_are_refused() {
    let deny = |entry: &str| file(&format!("\n[lists]\ndeny_keys = [{entry:?}]\n"));
    for entry in [
        "Key:stolen-key",
        "KEY:stolen-key",
        " key:stolen-key",
        "key :stolen-key",
        "user:42",
        "stolen-key",
    ] {
        let err = error(&deny(entry), 10, 14);
        assert!(
            err.contains("in lower case and without spaces"),
            "{entry}: {err}"
        );
        assert!(!err.contains("stolen"), "the key is repeated: {err}");
    }
    for entry in ["key: stolen-key", "key:stolen-key ", "key:"] {
        let err = error(&deny(entry), 10, 14);
        assert!(!err.contains("stolen"), "the key is repeated: {err}");
    }
    let err = error(&deny("ip:2001:DB8::1"), 10, 14);
    assert!(err.contains("\"ip:2001:db8::/64\""), "{err}");
    let err = error(&deny("ip:10.0.0.0/8"), 10, 14);
    assert!(err.contains("deny_networks"), "{err}");
    for entry in ["key:stolen-key", "ip:203.0.113.9", "ip:2001:db8::/64"] {
        LimitsFile::parse("limits.toml", &deny(entry)).unwrap();
    }
    // A tier's key with a space is no key a request sends either.
    let text = file("\n[tiers]\n\"pro-key \" = \"api\"\n");
    let err = error(&text, 10, 1);
    assert!(
        err.contains("whitespace") && !err.contains("pro-key"),
        "{err}"
    );
}

/// `127.77.0.9/16` meant the whole /16: refused, with both spellings it could mean.
#[test]
fn a_network_with_host_bits_is_refused_with_both_meanings() {
    let text = file("\n[lists]\nallow_networks = [\"127.77.0.9/16\"]\n");
    let err = error(&text, 10, 19);
    assert!(
        err.contains("write 127.77.0.0/16") && err.contains("127.77.0.9/32"),
        "{err}"
    );
    let text = file("\n[lists]\ndeny_networks = [\"2001:db8::1/32\"]\n");
    let err = error(&text, 10, 18);
    assert!(err.contains("2001:db8::/32"), "{err}");
    let proxies = format!(
        "[key]\nclient_ip = {{ header = \"x-forwarded-for\", trusted_proxies = [\"10.1.2.3/8\"] }}\n{}",
        file("")
    );
    let err = error(&proxies, 2, 62);
    assert!(err.contains("10.0.0.0/8"), "{err}");
}

/// A policy that no route, tier or default names limits nothing: refused at its table,
/// so a file whose policy lost its route fails `check`, not the server (whose
/// `settle` or shadow flag names it).
#[test]
fn a_policy_nothing_names_is_refused_where_it_is() {
    let policy = "\n[policies.checkout]\nalgorithm = \"gcra\"\nlimit = 1\nperiod = \"1s\"\n";
    let err = error(&file(policy), 9, 1);
    assert!(
        err.contains("policy \"checkout\" limits nothing") && err.contains("[[routes]]"),
        "{err}"
    );
    // In shadow, it failed at build with no file or line.
    let text =
        file("\n[policies.x]\nalgorithm = \"gcra\"\nlimit = 1\nperiod = \"1s\"\nshadow = true\n");
    error(&text, 9, 1);
}

/// `check`'s summary names each tier key and listed API key by a few characters only.
#[test]
fn the_summary_holds_no_api_key() {
    let text = format!(
        "[key]\napi_key = {{ header = \"x-api-key\" }}\n\n{}",
        file(
            "\n[tiers]\n\"sk-live-4f9a8b7c\" = \"api\"\n\n[lists]\ndeny_keys = [\"key:stolen-5e6d\", \"ip:203.0.113.9\"]\n"
        )
    );
    let summary = LimitsFile::parse("limits.toml", &text).unwrap().summary();
    assert!(
        !summary.contains("4f9a8b7c") && !summary.contains("5e6d"),
        "{summary}"
    );
    assert!(summary.contains("tier: key \"sk-…\" -> api"), "{summary}");
    assert!(summary.contains("deny key: key:\"st…\""), "{summary}");
    assert!(summary.contains("deny key: ip:203.0.113.9"), "{summary}");
    // Nor does an error quoting a value of the wrong type.
    let text = file("\n[lists]\ndeny_keys = \"key:stolen-5e6d\"\n");
    let err = error(&text, 10, 13);
    assert!(!err.contains("5e6d"), "{err}");
    // Nor the Debug form.
    let debug = format!(
        "{:?}",
        LimitsFile::parse(
            "limits.toml",
            &file("\n[tiers]\n\"sk-live-4f9a8b7c\" = \"api\"\n")
        )
        .unwrap()
    );
    assert!(!debug.contains("4f9a8b7c"), "{debug}");
}

/// A byte that is not UTF-8 is named by its line and column.
#[test]
fn invalid_utf8_is_refused_at_its_byte() {
    let mut bytes = file("\n[tiers]\n\"pro").into_bytes();
    bytes.extend_from_slice(b"\xff\" = \"api\"\n");
    let err = LimitsFile::from_bytes("limits.toml", &bytes)
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("limits.toml:10:5: byte 0xff is not UTF-8"),
        "{err}"
    );
    // And as `read` (what `check` and the server call) finds it on disk.
    let path = std::env::temp_dir().join(format!("tollway-utf8-{}.toml", std::process::id()));
    std::fs::write(&path, &bytes).unwrap();
    let err = LimitsFile::read(&path).unwrap_err().to_string();
    std::fs::remove_file(&path).unwrap();
    assert!(
        err.starts_with(&format!("{}:10:5: ", path.display())),
        "{err}"
    );
}

/// A dotted key deeper than toml reads had no place; it is at its line now.
#[test]
fn an_over_deep_dotted_key_is_refused_at_its_line() {
    let text = file(&format!("\n  {}x = 1\n", "a.".repeat(85)));
    let err = error(&text, 9, 3);
    assert!(err.contains("policies.api.limit"), "{err}");
    let text = file(&format!("\n[{}x]\n", "a.".repeat(85)));
    error(&text, 9, 1);
}

/// A token budget beside the request rate, said in the file: each call reserves the
/// number in its `x-max-tokens` and is settled to the `x-tokens-used` of its response.
const TOKENS: &str = "\n[policies.tokens]\nalgorithm = \"token_bucket\"\nlimit = 100\nperiod = \"1m\"\ncost = { header = \"x-max-tokens\", default = 50, max = 60, written_by = \"gateway\" }\nsettle = { header = \"x-tokens-used\", unsettled = \"refund\" }\n\n[[routes]]\npath = \"/llm\"\npolicy = \"tokens\"\n";

/// A layer of `limits` over a memory store, around a handler that reports the tokens a
/// request's `x-reply-used` says in `x-tokens-used`.
fn settling_service(
    limits: &LimitsFile,
) -> impl tower::Service<
    http::Request<()>,
    Response = http::Response<crate::ResponseBody<http_body_util::Full<bytes::Bytes>>>,
    Error = std::convert::Infallible,
> {
    use tower::Layer;
    let store = tollway_core::MemoryStore::builder()
        .clock(tollway_core::ManualClock::new())
        .build()
        .unwrap();
    let layer = limits.layer(store, limits.key().unwrap()).unwrap();
    layer.layer(tower::service_fn(|request: http::Request<()>| async move {
        let mut response = http::Response::new(http_body_util::Full::new(bytes::Bytes::new()));
        if let Some(used) = request.headers().get("x-reply-used") {
            response.headers_mut().insert("x-tokens-used", used.clone());
        }
        Ok::<_, std::convert::Infallible>(response)
    }))
}

/// Calls `service` on `path` with `headers`, reads the whole response (which settles
/// it) and answers its `x-ratelimit-remaining`.
async fn remaining_after<S>(service: &mut S, path: &str, headers: &[(&str, &str)]) -> String
where
    S: tower::Service<
            http::Request<()>,
            Response = http::Response<crate::ResponseBody<http_body_util::Full<bytes::Bytes>>>,
            Error = std::convert::Infallible,
        >,
{
    use http_body_util::BodyExt;
    use tower::ServiceExt;
    let mut request = http::Request::get(path).body(()).unwrap();
    let peer: std::net::SocketAddr = "203.0.113.9:4000".parse().unwrap();
    request.extensions_mut().insert(peer);
    for &(name, value) in headers {
        let name = http::HeaderName::from_bytes(name.as_bytes()).unwrap();
        request.headers_mut().append(name, value.parse().unwrap());
    }
    let response = service.ready().await.unwrap().call(request).await.unwrap();
    let left = response.headers()["x-ratelimit-remaining"]
        .to_str()
        .unwrap()
        .to_owned();
    response.into_body().collect().await.unwrap();
    left
}

#[tokio::test]
async fn a_policy_reserves_from_a_request_header_and_settles_from_the_response() {
    // A request rate that never says less than the tokens do.
    let api = "algorithm = \"gcra\"\nlimit = 1000\nperiod = \"1s\"";
    let limits = LimitsFile::parse("limits.toml", &super::tests::file(api, TOKENS)).unwrap();
    let summary = limits.summary();
    assert!(
        summary.contains("policy tokens: token_bucket of 100 per 60s, burst 100 (cost: x-max-tokens, default 50, min 1, max 60, written by gateway) (settled: x-tokens-used, unsettled refund)"),
        "{summary}"
    );
    let mut service = settling_service(&limits);
    let mut call =
        async |headers: &[(&str, &str)]| remaining_after(&mut service, "/llm", headers).await;
    // Reserves 60 (the headers say what is left then), settled to 20.
    assert_eq!(
        call(&[("x-max-tokens", "60"), ("x-reply-used", "20")]).await,
        "40"
    );
    // No header: the default, 50; no usage reported, and it answered: kept.
    assert_eq!(call(&[]).await, "30");
    // 0 costs the floor, 1; a number past the ceiling costs it, 60, which 29 cannot take.
    assert_eq!(call(&[("x-max-tokens", "0")]).await, "29");
    assert_eq!(call(&[("x-max-tokens", "99999999999")]).await, "29");
    // Past 2^64 or negative: not a number, so the default, 50, which 29 cannot take.
    assert_eq!(
        call(&[("x-max-tokens", "18446744073709551616")]).await,
        "29"
    );
    assert_eq!(call(&[("x-max-tokens", "-1")]).await, "29");
    // Sent twice: the first value counts (1), not the larger.
    let twice = [("x-max-tokens", "1"), ("x-max-tokens", "4096")];
    assert_eq!(call(&twice).await, "28");
    assert!(limits.warnings().is_empty(), "the gateway writes it");
}

/// A settled tier with a key's plan on it: the key's call reserves from its own 1,000
/// and is settled there, not at the tier's 100.
#[tokio::test]
async fn a_plan_of_a_settled_tier_settles_at_its_own_quota() {
    let text = format!(
        "[key]\napi_key = {{ header = \"x-api-key\" }}\n\n{}",
        super::tests::file(
            "algorithm = \"gcra\"\nlimit = 10\nperiod = \"1s\"",
            "\n[policies.tokens]\nalgorithm = \"token_bucket\"\nlimit = 100\nperiod = \"1m\"\n\
             cost = { header = \"x-max-tokens\", default = 50, max = 600, written_by = \"gateway\" }\n\
             settle = { header = \"x-tokens-used\", unsettled = \"refund\" }\n\n\
             [tiers]\n\"k-small\" = \"tokens\"\n\n[plans]\n\"k-acme\" = { tier = \"tokens\", limit = 1_000 }\n",
        )
    );
    let limits = LimitsFile::parse("limits.toml", &text).unwrap();
    let mut service = settling_service(&limits);
    let acme = |max, used| {
        [
            ("x-api-key", "k-acme"),
            ("x-max-tokens", max),
            ("x-reply-used", used),
        ]
    };
    // Reserves 600 of 1,000, settled to 100; then 1 more, used.
    assert_eq!(
        remaining_after(&mut service, "/", &acme("600", "100")).await,
        "400"
    );
    assert_eq!(
        remaining_after(&mut service, "/", &acme("1", "1")).await,
        "899"
    );
    // The tier's own callers reserve from 100.
    let small = [("x-api-key", "k-small"), ("x-max-tokens", "60")];
    assert_eq!(remaining_after(&mut service, "/", &small).await, "40");
}

// A cost from a header any client can send, that nothing says the gateway writes:
// valid, and warned about at the header, with what to write.
#[test]
fn a_cost_from_a_header_a_client_can_send_is_warned_about() {
    let text = TOKENS.replace(", written_by = \"gateway\"", "");
    let limits = LimitsFile::parse("limits.toml", &file(&text)).unwrap();
    let warnings = limits.warnings();
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(
        warnings[0].starts_with("limits.toml:13:19: "),
        "{}",
        warnings[0]
    );
    assert!(
        warnings[0].contains("between min = 1 and max = 60"),
        "{}",
        warnings[0]
    );
    let client = TOKENS.replace("written_by = \"gateway\"", "written_by = \"client\"");
    let limits = LimitsFile::parse("limits.toml", &file(&client)).unwrap();
    assert!(limits.warnings().is_empty());
}

#[test]
fn costs_and_settlements_that_cannot_work_are_refused_where_they_are() {
    let tokens = |cost: &str, settle: &str| {
        format!(
            "\n[policies.tokens]\nalgorithm = \"token_bucket\"\nlimit = 100\nperiod = \"1m\"\n{cost}\n{settle}\n\n[[routes]]\npath = \"/llm\"\npolicy = \"tokens\"\n"
        )
    };
    let with = |cost: &str, settle: &str| file(&tokens(cost, settle));
    let err = error(&with("cost = { header = \"x max\" }", ""), 13, 19);
    assert!(err.contains("not a header name"), "{err}");
    let err = error(
        &with("cost = { header = \"x-max\", default = -1 }", ""),
        13,
        38,
    );
    assert!(err.contains("write 1 to"), "{err}");
    // A floor of 0 would let a request pass an empty budget.
    let err = error(&with("cost = { header = \"x-max\", min = 0 }", ""), 13, 34);
    assert!(err.contains("cost nothing"), "{err}");
    let err = error(
        &with("cost = { header = \"x-max\", min = 5, max = 4 }", ""),
        13,
        43,
    );
    assert!(err.contains("under min = 5"), "{err}");
    let err = error(
        &with("cost = { header = \"x-max\", default = 50, max = 4 }", ""),
        13,
        38,
    );
    assert!(err.contains("outside min = 1 and max = 4"), "{err}");
    let err = error(
        &with("cost = { header = \"x-max\", written_by = \"proxy\" }", ""),
        13,
        41,
    );
    assert!(err.contains("[\"gateway\", \"client\"]"), "{err}");
    // Settled on a window, which forgets a debt when it ends.
    let window = tokens("", "settle = { header = \"x-used\" }")
        .replace("\"token_bucket\"", "\"fixed_window\"");
    let err = LimitsFile::parse("limits.toml", &file(&window))
        .and_then(|f| {
            f.layer(tollway_core::MemoryStore::new(), f.key()?)
                .map(|_| ())
        })
        .unwrap_err()
        .to_string();
    assert!(err.contains("keep it as a debt"), "{err}");
    let err = error(&with("", "settle = { unsettled = \"maybe\" }"), 14, 24);
    assert!(err.contains("[\"keep\", \"refund\"]"), "{err}");
    // Two settled policies: refused at the second, in the order the file is read.
    let api = format!("{API}\nsettle = {{ header = \"x-used\" }}");
    let two = super::tests::file(&api, &tokens("", "settle = { header = \"x-used\" }"));
    let err = error(&two, 15, 10);
    assert!(err.contains("one policy of a layer is settled"), "{err}");
}

/// A limit on calls in flight is said as what it is: slots at once, and how long one
/// lives unrenewed.
#[test]
fn a_limit_on_calls_in_flight_is_summarised_as_slots() {
    let streams = "\n[policies.streams]\nalgorithm = \"concurrency\"\nlimit = 4\nperiod = \"30s\"\n\n[[routes]]\npath = \"/llm\"\npolicy = \"streams\"\n";
    let summary = LimitsFile::parse("limits.toml", &file(streams))
        .unwrap()
        .summary();
    assert!(
        summary.contains("policy streams: concurrency of 4 at once, a slot living 30s unrenewed\n"),
        "{summary}"
    );
}

/// Limits and bursts count up to 2^53 where the algorithm can: a fixed window of 10^10
/// a month is accepted; a token bucket of it, or a limit past 2^53, is refused at the
/// limit, saying what to write.
#[test]
fn limits_past_u32_are_accepted_up_to_what_the_algorithm_keeps_exact() {
    let policy = |algorithm: &str, limit: u64| {
        format!("algorithm = \"{algorithm}\"\nlimit = {limit}\nperiod = \"30d\"")
    };
    let month = super::tests::file(&policy("fixed_window", 10_000_000_000), "");
    let parsed = LimitsFile::parse("limits.toml", &month).unwrap();
    assert!(
        parsed.summary().contains("10000000000"),
        "{}",
        parsed.summary()
    );
    let bucket = super::tests::file(&policy("token_bucket", 10_000_000_000), "");
    let err = error(&bucket, 6, 9);
    assert!(
        err.contains("2^52") && err.contains("fixed window"),
        "{err}"
    );
    let past = super::tests::file(&policy("fixed_window", (1 << 53) + 1), "");
    let err = error(&past, 6, 9);
    assert!(
        err.contains("write a limit of 1 to 9007199254740992"),
        "{err}"
    );
}

/// A calendar period names its unit, and its zone if not UTC: a wrong unit, an unknown
/// zone, a zone without a calendar or a calendar for a bucket is refused where it is
/// written.
#[test]
fn calendar_periods_are_checked_where_they_are_written() {
    let policy = |algorithm: &str, period: &str, zone: &str| {
        format!("algorithm = \"{algorithm}\"\nlimit = 100\nperiod = \"{period}\"\n{zone}")
    };
    let month =
        |zone: &str| super::tests::file(&policy("fixed_window", "calendar month", zone), "");
    let parsed = LimitsFile::parse("limits.toml", &month("zone = \"Europe/Paris\"")).unwrap();
    assert!(
        parsed
            .summary()
            .contains("100 a calendar month in Europe/Paris"),
        "{}",
        parsed.summary()
    );
    let err = error(&month("zone = \"Europe/Atlantis\""), 8, 8);
    assert!(err.contains("IANA"), "{err}");
    let fortnight = super::tests::file(&policy("fixed_window", "calendar fortnight", ""), "");
    let err = error(&fortnight, 7, 10);
    assert!(err.contains("\"calendar month\""), "{err}");
    let zoned = super::tests::file(&policy("fixed_window", "1d", "zone = \"UTC\""), "");
    let err = error(&zoned, 8, 8);
    assert!(err.contains("calendar period"), "{err}");
    let bucket = super::tests::file(&policy("token_bucket", "calendar day", ""), "");
    let err = error(&bucket, 6, 9);
    assert!(err.contains("fixed_window"), "{err}");
}

/// A key's plan: its tier's policy at a limit of its own, checked where it is written,
/// and summarised without the key.
#[test]
fn plans_are_checked_where_they_are_written() {
    let pro = "\n[policies.pro]\nalgorithm = \"gcra\"\nlimit = 100\nperiod = \"1m\"\n";
    let plans = |entry: &str| {
        format!(
            "[key]\napi_key = {{ header = \"x-api-key\" }}\n\n{}",
            file(&format!("{pro}\n[plans]\n\"sk-acme-4f9a\" = {entry}\n"))
        )
    };
    let text = plans("{ tier = \"pro\", limit = 50_000, burst = 60_000 }");
    let parsed = LimitsFile::parse("limits.toml", &text).unwrap();
    let summary = parsed.summary();
    assert!(
        summary.contains("plan: key \"sk-…\" -> pro at 50000, burst 60000"),
        "{summary}"
    );
    assert!(!summary.contains("4f9a"), "{summary}");
    assert!(parsed.known_keys().contains("sk-acme-4f9a"));

    let err = error(&plans("{ tier = \"gold\", limit = 5 }"), 18, 27);
    assert!(err.contains("no policy is named \"gold\""), "{err}");
    let err = error(&plans("{ tier = \"pro\", limit = 0 }"), 18, 42);
    assert!(err.contains("write a limit of 1 to"), "{err}");
    let err = error(&plans("{ tier = \"pro\", limit = 9, burst = 5 }"), 18, 53);
    assert!(err.contains("at least 9"), "{err}");
    let err = error(
        &plans("{ tier = \"pro\", limit = 9, per = \"1s\" }"),
        18,
        45,
    );
    assert!(err.contains("per"), "{err}");
    // A window's plan has no burst, and its tier's algorithm says so.
    let window = plans("{ tier = \"pro\", limit = 9 }")
        .replace("gcra\"\nlimit = 100", "fixed_window\"\nlimit = 100");
    LimitsFile::parse("limits.toml", &window).unwrap();
    let err = error(
        &window.replace("limit = 9 }", "limit = 9, burst = 20 }"),
        18,
        53,
    );
    assert!(err.contains("no burst"), "{err}");
    // A key is in [tiers] or in [plans], not both.
    let both = format!(
        "{}\n[tiers]\n\"sk-acme-4f9a\" = \"pro\"\n",
        plans("{ tier = \"pro\", limit = 9 }")
    );
    let err = error(&both, 21, 1);
    assert!(err.contains("remove it from [tiers]"), "{err}");
    assert!(!err.contains("4f9a"), "{err}");
}
