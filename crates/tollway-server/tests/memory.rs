//! What one hostile connection costs the server's memory: the binary runs in its own
//! process, so its resident memory is its own, and one gRPC connection sends the
//! largest bucket ids the quota service reads, on as many streams as it may open.

#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_client::RateLimitQuotaServiceClient;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{BucketId, RateLimitQuotaUsageReports};
use tollway_server::bounds::VALUE_BYTES;
use tollway_server::quota::{MAX_BUCKETS, STREAMS_PER_CONNECTION};

/// The most the server's resident memory may reach during the attack: what SECURITY.md
/// states for one connection, over the process's own.
const PEAK_MIB: u64 = 320;

const LIMITS: &str = r#"
[layer]
default = "per_key"

[policies.per_key]
algorithm = "token_bucket"
limit = 100
period = "1s"

[[buckets]]
domain = "edge"
entries = [{ key = "api_key" }]
policy = "per_key"
"#;

/// The server binary on free loopback ports, and its gRPC address (read from its log).
fn server(config: &std::path::Path) -> (Child, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_tollway-server"))
        .args(["--config", config.to_str().unwrap()])
        .args([
            "--grpc",
            "127.0.0.1:0",
            "--http",
            "127.0.0.1:0",
            "--log",
            "json",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let grpc = loop {
        let line = lines
            .next()
            .expect("the server logs where it serves")
            .unwrap();
        if let Some(at) = line.find("\"grpc\":\"") {
            let rest = &line[at + 8..];
            break rest[..rest.find('"').unwrap()].to_owned();
        }
    };
    // The rest of its log is not read: drained so that it never blocks.
    std::thread::spawn(move || for _ in lines {});
    (child, grpc)
}

/// A line of `/proc/<pid>/status`, in MiB.
fn status_mib(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status
        .lines()
        .find(|l| l.starts_with(field))
        .unwrap_or_else(|| panic!("{field} in {status}"));
    let kib: u64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap();
    kib / 1024
}

/// A report of `count` buckets, each with a value of the longest length a bucket id may
/// have, numbered from `first` so that no two are the same.
fn longest_ids(first: usize, count: usize) -> RateLimitQuotaUsageReports {
    RateLimitQuotaUsageReports {
        domain: "edge".to_owned(),
        bucket_quota_usages: (first..first + count)
            .map(|n| {
                let mut value = format!("{n:08}");
                value.extend(std::iter::repeat_n('v', VALUE_BYTES - value.len()));
                BucketQuotaUsage {
                    bucket_id: Some(BucketId {
                        bucket: HashMap::from([("api_key".to_owned(), value)]),
                    }),
                    time_elapsed: None,
                    num_requests_allowed: 1,
                    num_requests_denied: 0,
                }
            })
            .collect(),
    }
}

// One connection opens the streams it may, and sends reports of the longest bucket ids a
// report holds, past the number of buckets a stream keeps. The server keeps a bucket's
// hash, not its id, and gives the quietest's place to a new one: its memory stays under
// the stated peak, and a stream past the connection's bound is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_connection_of_the_longest_ids_stays_within_the_stated_memory() {
    let dir = std::env::temp_dir().join(format!("tollway-memory-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("limits.toml");
    std::fs::write(&config, LIMITS).unwrap();
    let (mut child, grpc) = server(&config);
    let pid = child.id();
    let before = status_mib(pid, "VmRSS:");

    let channel = tonic::transport::Channel::from_shared(format!("http://{grpc}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let client = RateLimitQuotaServiceClient::new(channel)
        .max_encoding_message_size(usize::MAX)
        .max_decoding_message_size(usize::MAX);
    // A report of the longest ids that fits the message bound.
    let per_report = tollway_server::quota::MESSAGE_BYTES / (VALUE_BYTES + 64);
    let reports_for_past_the_cap = MAX_BUCKETS / per_report + 2;
    let mut streams = Vec::new();
    for s in 0..STREAMS_PER_CONNECTION {
        let mut client = client.clone();
        let reports = if s == 0 { reports_for_past_the_cap } else { 3 };
        streams.push(tokio::spawn(async move {
            let (sender, outbound) = tokio::sync::mpsc::channel(1);
            let mut answers = client
                .stream_rate_limit_quotas(tokio_stream::wrappers::ReceiverStream::new(outbound))
                .await
                .unwrap()
                .into_inner();
            for r in 0..reports {
                let first = (s * 1_000 + r) * per_report;
                sender.send(longest_ids(first, per_report)).await.unwrap();
                let answer = answers.message().await.unwrap().expect("an answer");
                assert!(!answer.bucket_action.is_empty());
            }
            (sender, answers)
        }));
    }
    let mut open = Vec::new();
    for stream in streams {
        open.push(
            tokio::time::timeout(Duration::from_secs(300), stream)
                .await
                .unwrap()
                .unwrap(),
        );
    }
    // One stream more on the same connection is refused.
    let (_sender, outbound) = tokio::sync::mpsc::channel::<RateLimitQuotaUsageReports>(1);
    let refused = client
        .clone()
        .stream_rate_limit_quotas(tokio_stream::wrappers::ReceiverStream::new(outbound))
        .await
        .map(drop)
        .unwrap_err();
    assert_eq!(
        refused.code(),
        tonic::Code::ResourceExhausted,
        "{refused:?}"
    );

    let (peak, after) = (status_mib(pid, "VmHWM:"), status_mib(pid, "VmRSS:"));
    let sent = (reports_for_past_the_cap + 3 * (STREAMS_PER_CONNECTION - 1)) * per_report;
    eprintln!(
        "{sent} bucket ids of {VALUE_BYTES} bytes on one connection: server RSS {before} MiB \
         before, {peak} MiB at most, {after} MiB after"
    );
    drop(open);
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        peak <= before + PEAK_MIB,
        "the server reached {peak} MiB (from {before} MiB): past {PEAK_MIB} MiB more"
    );
}
