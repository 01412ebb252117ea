//! `[shed]`: load shedding from the limits file, checked where it is written, kept
//! across a reload that leaves it alone.

use tollway_core::MemoryStore;

use super::tests::{API, error, file};
use super::{LimitsFile, Reloader};

const SHED: &str = "
[shed]
floor = 10
ceiling = 400
tolerance = 2.0
window = \"500ms\"

[[shed.priorities]]
name = \"checkout\"
share = 0.5
routes = [\"POST /api/v1/checkout\"]

[[shed.priorities]]
name = \"paying\"
share = 0.3
headers = { x-plan = [\"gold\", \"platinum\"] }
";

#[test]
fn a_shed_section_builds_a_shedder_and_is_summarised() {
    let limits = LimitsFile::parse("limits.toml", &file(API, SHED)).unwrap();
    let shed = limits.shed().unwrap().expect("a shedder");
    assert_eq!(shed.limit(), 10);
    let names: Vec<_> = shed.priorities().into_iter().map(|p| p.name).collect();
    assert_eq!(names, ["checkout", "paying", "other"]);
    let layer = limits
        .layer(MemoryStore::new(), limits.key().unwrap())
        .unwrap();
    assert!(layer.shed().is_some());
    let summary = limits.summary();
    for line in [
        "  shed: calls in flight between 10 and 400, latency tolerance 2, window 500ms, \
         0.25 of a share per address\n",
        "  shed priority checkout: share 0.5 (POST /api/v1/checkout)\n",
        "  shed priority paying: share 0.3 (header x-plan in 2 values)\n",
        "  shed priority other: share 0.2 (the rest)\n",
    ] {
        assert!(summary.contains(line), "{line:?} in\n{summary}");
    }
}

#[test]
fn a_shed_setting_that_cannot_work_is_refused_where_it_is() {
    let with = |replace: &str, by: &str| file(API, &SHED.replace(replace, by));
    let err = error(&with("\"POST /api", "\"post /api"), 18, 11);
    assert!(err.contains("not an upper-case HTTP method"), "{err}");
    let err = error(&with("/api/v1/checkout", "api/v1/checkout"), 18, 11);
    assert!(err.contains("must start with '/'"), "{err}");
    let err = error(&with("x-plan", "\"x plan\""), 23, 11);
    assert!(err.contains("not a header name"), "{err}");
    // A header's presence: claimable by any client, so refused unless asked for.
    let names = "headers = [\"x-api-key\"]";
    let err = error(
        &with("headers = { x-plan = [\"gold\", \"platinum\"] }", names),
        23,
        11,
    );
    assert!(err.contains("any client can send a header"), "{err}");
    assert!(err.contains("headers_present = [\"x-api-key\"]"), "{err}");
    let present = with(
        "headers = { x-plan = [\"gold\", \"platinum\"] }",
        "headers_present = [\"x-api-key\"]",
    );
    let summary = LimitsFile::parse("limits.toml", &present)
        .unwrap()
        .summary();
    assert!(
        summary.contains("shed priority paying: share 0.3 (header x-api-key present (claimable))"),
        "{summary}"
    );
    let err = LimitsFile::parse(
        "limits.toml",
        &with("floor = 10", "floor = 10\nper_address = 0.0"),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("per_address (0)"), "{err}");
    let err = error(&with("window = \"500ms\"", "window = \"soon\""), 13, 10);
    assert!(err.contains("window = \"1s\""), "{err}");
    let err = error(
        &with("headers = { x-plan = [\"gold\", \"platinum\"] }", ""),
        20,
        1,
    );
    assert!(err.contains("matches no request"), "{err}");
    // Over the whole of the limit: refused at the section, with what to write.
    let err = LimitsFile::parse("limits.toml", &with("share = 0.3", "share = 0.7"))
        .unwrap_err()
        .to_string();
    assert!(err.starts_with("limits.toml:"), "{err}");
    assert!(err.contains("the shares add up to 1.2"), "{err}");
    let err = LimitsFile::parse("limits.toml", &with("floor = 10", "floor = 0"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("the floor (0) must be at least 1"), "{err}");
}

// A reload that leaves [shed] alone keeps the running shedder: its calls in flight and
// its learnt limit. One that changes it starts the new shedder at the running limit.
#[tokio::test]
async fn a_reload_keeps_an_unchanged_shedder_and_carries_a_changed_ones_limit() {
    let dir = std::env::temp_dir().join(format!("tollway-shed-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("limits.toml");
    std::fs::write(&path, file(API, SHED)).unwrap();
    let reloader = Reloader::new(&path, MemoryStore::new()).unwrap();
    let running = reloader.layer().shed().unwrap();

    // A policy changes; [shed] does not.
    let raised = API.replace("limit = 10", "limit = 20");
    std::fs::write(&path, file(&raised, SHED)).unwrap();
    reloader.reload().await.unwrap();
    let kept = reloader.layer().shed().unwrap();
    assert!(kept.same_settings(&running));
    running.set_shadow(true);
    assert!(kept.is_shadow(), "one shedder, not a copy");

    // The floor and the initial limit change: the new one starts at the running limit.
    std::fs::write(
        &path,
        file(
            &raised,
            &SHED.replace("floor = 10", "floor = 5\ninitial = 8"),
        ),
    )
    .unwrap();
    reloader.reload().await.unwrap();
    let changed = reloader.layer().shed().unwrap();
    assert!(!changed.same_settings(&running));
    assert_eq!(
        changed.limit(),
        10,
        "the running limit, not its own initial 8"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

// Pro before free, by the API keys the file gives each tier; a tier no key has is
// refused where it is written.
#[test]
fn a_priority_by_tier_takes_that_tiers_api_keys() {
    let text = "[layer]\ndefault = \"api\"\n\n[key]\napi_key = { header = \"x-api-key\" }\n\n[policies.api]\nalgorithm = \"gcra\"\nlimit = 10\nperiod = \"1s\"\n\n[policies.pro]\nalgorithm = \"gcra\"\nlimit = 100\nperiod = \"1s\"\n\n[tiers]\n\"pro-key\" = \"pro\"\n\n[shed]\n\n[[shed.priorities]]\nname = \"pro\"\nshare = 0.5\ntiers = [\"pro\"]\n";
    let shed = LimitsFile::parse("limits.toml", text)
        .unwrap()
        .shed()
        .unwrap()
        .unwrap();
    let request = |key: &str| {
        http::Request::builder()
            .header("x-api-key", key)
            .body(())
            .unwrap()
    };
    let _pro = shed.admit(&request("pro-key"), None).unwrap();
    let _guess = shed.admit(&request("guessed-key"), None).unwrap();
    let in_flight: Vec<_> = shed.priorities().iter().map(|p| p.in_flight).collect();
    assert_eq!(in_flight, [1, 1], "a key not in the tier is other");
    let err = error(&text.replace("[\"pro\"]\n", "[\"gold\"]\n"), 25, 10);
    assert!(
        err.contains("no key in [tiers] or [plans] is of tier \"gold\""),
        "{err}"
    );
}
