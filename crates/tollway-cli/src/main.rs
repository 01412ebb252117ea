//! `tollway check FILE...`: validates limits files and prints the limits each describes,
//! for a CI pipeline to refuse a bad edit before it reaches a gateway. Exits 0 when every
//! file is valid, 1 when one is not (its error on stderr: `file:line:column: what is
//! wrong and what to write instead`), 2 on a usage error. A valid file may still get
//! warnings on stderr (`warning: file:line:column: ...`): what it lets a client do that
//! it may not mean to.

use std::process::ExitCode;

use tollway_tower::config::LimitsFile;

const USAGE: &str = "usage: tollway check FILE...";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.split_first() {
        Some((command, files)) if command == "check" && !files.is_empty() => check(files),
        _ => {
            eprintln!("{USAGE}");
            ExitCode::from(2)
        }
    }
}

fn check(files: &[String]) -> ExitCode {
    let mut valid = true;
    for path in files {
        match LimitsFile::read(path) {
            Ok(file) => {
                print!("{}", file.summary());
                for warning in file.warnings() {
                    eprintln!("warning: {warning}");
                }
            }
            Err(error) => {
                eprintln!("{error}");
                valid = false;
            }
        }
    }
    if valid {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
