//! `tollway check`, run as a user's CI pipeline runs it.

#![allow(clippy::unwrap_used)]

use std::process::Command;

fn tollway(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_tollway"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code().unwrap(),
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    )
}

/// The example's file is valid and described a line a limit; a broken one fails the
/// pipeline with its line and column; no file is a usage error.
#[test]
fn check_passes_a_valid_file_and_fails_a_broken_one_with_its_line() {
    let example = concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/tollway.toml");
    let (code, out, _) = tollway(&["check", example]);
    assert_eq!(code, 0);
    assert!(
        out.contains("policy anonymous: token_bucket of 20 per 60s, burst 20 (default)"),
        "{out}"
    );
    assert!(
        out.contains("route: * /api/v1/checkout -> checkout"),
        "{out}"
    );
    assert!(
        out.contains("shed priority checkout: share 0.2 (POST /api/v1/checkout)"),
        "{out}"
    );

    let dir = std::env::temp_dir().join(format!("tollway-check-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let broken = dir.join("broken.toml");
    std::fs::write(&broken, "[layer]\ndefault = \"api\"\n\n[policies.api]\nalgorithm = \"gcra\"\nlimit = 0\nperiod = \"1s\"\n").unwrap();
    let broken = broken.to_str().unwrap();
    let (code, out, err) = tollway(&["check", example, broken]);
    assert_eq!(code, 1);
    assert!(out.contains("valid"), "{out}");
    assert!(err.starts_with(&format!("{broken}:6:9: ")), "{err}");

    let (code, _, err) = tollway(&[]);
    assert_eq!((code, err.trim()), (2, "usage: tollway check FILE..."));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A CI log holds no API key: the tiers' and the lists' keys are shown by a few
/// characters. And a file whose policy lost its route fails `check`, at the policy.
#[test]
fn check_prints_no_api_key_and_refuses_a_policy_without_its_route() {
    let dir = std::env::temp_dir().join(format!("tollway-check-keys-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("limits.toml");
    let base = "[layer]\ndefault = \"api\"\n\n[key]\napi_key = { header = \"x-api-key\" }\n\n\
                [policies.api]\nalgorithm = \"gcra\"\nlimit = 10\nperiod = \"1m\"\n\n\
                [policies.pro]\nalgorithm = \"gcra\"\nlimit = 100\nperiod = \"1m\"\n\n";
    let keys =
        "[tiers]\n\"sk-live-4f9a8b7c\" = \"pro\"\n\n[lists]\ndeny_keys = [\"key:stolen-5e6d\"]\n";
    std::fs::write(&path, format!("{base}{keys}")).unwrap();
    let file = path.to_str().unwrap();
    let (code, out, err) = tollway(&["check", file]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("tier: key \"sk-…\" -> pro"), "{out}");
    assert!(!out.contains("4f9a8b7c") && !out.contains("5e6d"), "{out}");

    // `pro` lost the tier that named it.
    std::fs::write(&path, base).unwrap();
    let (code, _, err) = tollway(&["check", file]);
    assert_eq!(code, 1);
    assert!(
        err.starts_with(&format!("{file}:12:1: policy \"pro\" limits nothing")),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
