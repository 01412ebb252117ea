//! The binary's arguments: `--help` answers on standard output and succeeds; anything it
//! does not know fails with the usage, before it reads a file or binds a port.

#![allow(clippy::unwrap_used)]

use std::process::Command;

fn run(args: &[&str]) -> (i32, String, String) {
    let output = Command::new(env!("CARGO_BIN_EXE_tollway-server"))
        .args(args)
        .output()
        .unwrap();
    let text = |bytes: Vec<u8>| String::from_utf8(bytes).unwrap();
    (
        output.status.code().unwrap(),
        text(output.stdout),
        text(output.stderr),
    )
}

#[test]
fn help_is_a_flag() {
    for flag in ["--help", "-h"] {
        let (code, out, err) = run(&[flag]);
        assert_eq!(code, 0, "{err}");
        for said in [
            "--config FILE",
            "--grpc ADDR",
            "--http ADDR",
            "--log FORMAT",
        ] {
            assert!(out.contains(said), "{out}");
        }
    }
}

#[test]
fn an_unknown_or_incomplete_argument_is_refused_with_the_usage() {
    for args in [
        &["--bogus"][..],
        &["--grpc"],
        &["--grpc", "nowhere"],
        &["--log", "xml"],
    ] {
        let (code, out, err) = run(args);
        assert_eq!(code, 2, "{args:?}: {out}{err}");
        assert!(err.contains("usage: tollway-server"), "{args:?}: {err}");
    }
    let (_, _, err) = run(&["--bogus"]);
    assert!(err.contains("unknown argument \"--bogus\""), "{err}");
}
