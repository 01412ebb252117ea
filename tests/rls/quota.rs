//! The quota service (RLQS) end to end: real gRPC streams over Envoy's generated types,
//! two replicas on one real `redis-server`, and the memory store. The Envoys here are
//! clients that report as Envoy 1.40 does: a new bucket's first request at once (one
//! request, no time elapsed), then every bucket every 5 s.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::{BlanketRule, Strategy};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::BucketAction as Action;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_client::RateLimitQuotaServiceClient;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{
    BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use envoy_types::pb::google::protobuf::Duration as ProtoDuration;
use support::redis::RedisServer;
use tokio::sync::mpsc;
use tonic::Streaming;

use super::{File, shared};

/// The quota service's name, as gRPC health knows it.
const RLQS: &str = "envoy.service.rate_limit_quota.v3.RateLimitQuotaService";

async fn start(config: &std::path::Path) -> (tollway_server::Running, SocketAddr, SocketAddr) {
    super::start(config, None).await.unwrap()
}

/// A `[store]` on the Redis at `url`.
fn on_redis(url: &str) -> String {
    format!("[store]\nkind = \"redis\"\nurl = \"{url}\"\nstall_after_ms = 1000\n")
}

/// 100 a second per API key, a burst of 100; internal keys unlimited.
fn limits(store: &str) -> String {
    format!(
        r#"
{store}

[layer]
default = "per_key"

[policies.per_key]
algorithm = "token_bucket"
limit = 100
period = "1s"

[[buckets]]
domain = "edge"
entries = [{{ key = "api_key" }}]
policy = "per_key"

[[buckets]]
domain = "edge"
entries = [{{ key = "api_key", value = "internal-*" }}]
unlimited = true
"#
    )
}

/// One Envoy's stream to a server.
struct Envoy {
    reports: mpsc::Sender<RateLimitQuotaUsageReports>,
    answers: Streaming<RateLimitQuotaResponse>,
}

fn bucket(key: &str) -> BucketId {
    BucketId {
        bucket: HashMap::from([("api_key".to_owned(), key.to_owned())]),
    }
}

/// What a bucket was told, in short.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Told {
    /// A token bucket: tokens a second, most tokens.
    Bucket(u32, u32),
    Allow,
    Deny,
    Abandon,
    /// Not named in the answer: Envoy keeps what it has.
    Nothing,
}

/// What each bucket of an answer was told.
struct Answers(HashMap<String, Told>);

impl std::ops::Index<&str> for Answers {
    type Output = Told;

    fn index(&self, key: &str) -> &Told {
        self.0.get(key).unwrap_or(&Told::Nothing)
    }
}

impl Envoy {
    async fn connect(server: SocketAddr) -> Self {
        let mut client = RateLimitQuotaServiceClient::connect(format!("http://{server}"))
            .await
            .unwrap();
        let (reports, outbound) = mpsc::channel(16);
        let answers = client
            .stream_rate_limit_quotas(tokio_stream::wrappers::ReceiverStream::new(outbound))
            .await
            .unwrap()
            .into_inner();
        Envoy { reports, answers }
    }

    /// Reports `usages` (bucket key, allowed, denied, seconds elapsed) and reads the
    /// answer: what each bucket was told.
    async fn report(&mut self, usages: &[(&str, u64, u64, i64)]) -> Answers {
        let message = RateLimitQuotaUsageReports {
            domain: "edge".to_owned(),
            bucket_quota_usages: usages
                .iter()
                .map(|&(key, allowed, denied, secs)| BucketQuotaUsage {
                    bucket_id: Some(bucket(key)),
                    time_elapsed: Some(ProtoDuration {
                        seconds: secs,
                        nanos: 0,
                    }),
                    num_requests_allowed: allowed,
                    num_requests_denied: denied,
                })
                .collect(),
        };
        self.reports.send(message).await.unwrap();
        let answer = tokio::time::timeout(Duration::from_secs(10), self.answers.message())
            .await
            .expect("an answer within 10 s")
            .unwrap()
            .expect("the stream is open");
        Answers(told(&answer))
    }
}

fn told(answer: &RateLimitQuotaResponse) -> HashMap<String, Told> {
    answer
        .bucket_action
        .iter()
        .map(|action| {
            let key = action.bucket_id.as_ref().unwrap().bucket["api_key"].clone();
            let told = match action.bucket_action.as_ref().unwrap() {
                Action::AbandonAction(_) => Told::Abandon,
                Action::QuotaAssignmentAction(assignment) => {
                    let ttl = assignment.assignment_time_to_live.unwrap();
                    assert_eq!(
                        ttl.seconds,
                        tollway_server::quota::ASSIGNMENT_TTL.as_secs() as i64
                    );
                    match assignment.rate_limit_strategy.unwrap().strategy.unwrap() {
                        Strategy::TokenBucket(bucket) => {
                            let fill = bucket.fill_interval.unwrap();
                            assert_eq!((fill.seconds, fill.nanos), (1, 0));
                            Told::Bucket(bucket.tokens_per_fill.unwrap().value, bucket.max_tokens)
                        }
                        Strategy::BlanketRule(rule) if rule == BlanketRule::AllowAll as i32 => {
                            Told::Allow
                        }
                        Strategy::BlanketRule(_) => Told::Deny,
                        other => panic!("{other:?}"),
                    }
                }
            };
            (key, told)
        })
        .collect()
}

fn rate(told: Told) -> u32 {
    match told {
        Told::Bucket(rate, _) => rate,
        _ => 0,
    }
}

fn size(told: Told) -> u32 {
    match told {
        Told::Bucket(_, size) => size,
        _ => 0,
    }
}

// Three Envoys, two on one replica and one on another, both replicas on one Redis, ask
// for one API key's 100 a second: their rates never sum past the limit less the
// reserve (98), their buckets never past the burst, and the shares follow demand 10:1:1
// at twice the limit, then reversed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoys_on_two_replicas_share_one_limit_and_never_pass_it() {
    let redis = RedisServer::start();
    let file = File::new("rlqs-redis", &limits(&on_redis(&redis.url())));
    let (first, grpc_a, _) = start(&file.0).await;
    let (second, grpc_b, _) = start(&file.0).await;
    let mut envoys = [
        Envoy::connect(grpc_a).await,
        Envoy::connect(grpc_a).await,
        Envoy::connect(grpc_b).await,
    ];
    let mut now = [Told::Deny; 3];
    let check = |now: &[Told; 3]| {
        let rates: u32 = now.iter().map(|&t| rate(t)).sum();
        let sizes: u32 = now.iter().map(|&t| size(t)).sum();
        assert!(rates <= 98, "{now:?}");
        assert!(sizes <= 100, "{now:?}");
        rates
    };
    // The first request of each: at once, the whole limit asked (nothing known yet).
    for (i, envoy) in envoys.iter_mut().enumerate() {
        let answer = envoy.report(&[("k1", 1, 0, 0)]).await;
        now[i] = answer["k1"];
        check(&now);
    }
    assert_eq!(rate(now[0]), 98, "the first takes what is not reserved");
    for (phase, demand) in [[166u64, 17, 17], [17, 17, 166]].iter().enumerate() {
        for _ in 0..4 {
            for (i, envoy) in envoys.iter_mut().enumerate() {
                // 5 s of requests at this demand, as Envoy counts them.
                let allowed = (u64::from(rate(now[i])) * 5).min(demand[i] * 5);
                let denied = demand[i] * 5 - allowed;
                now[i] = envoy.report(&[("k1", allowed, denied, 5)]).await["k1"];
                check(&now);
            }
        }
        let rates = check(&now);
        assert!(rates >= 90, "phase {phase}: {now:?}");
        let busy = if phase == 0 { 0 } else { 2 };
        assert!(rate(now[busy]) >= 60, "phase {phase}: {now:?}");
        for i in 0..3 {
            assert!(rate(now[i]) >= 15, "phase {phase}: {now:?}");
        }
    }
    // What Envoys reported, and the buckets assigned anew, by the file's policy.
    let counted = super::metrics().render();
    for line in [
        "tollway_rlqs_buckets_total{policy=\"per_key\"}",
        "tollway_rlqs_reported_requests_total{policy=\"per_key\",outcome=\"denied\"}",
        "tollway_rlqs_reported_requests_total{policy=\"per_key\",outcome=\"allowed\"}",
    ] {
        assert!(counted.contains(line), "{line}: {counted}");
    }
    first.stop().await;
    second.stop().await;
}

// A quiet bucket keeps a share of what the others leave, then is abandoned after a
// minute of reports, its share going to the others; an unlimited key is allowed all,
// and so is a policy in shadow mode.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quiet_bucket_keeps_a_share_for_a_minute_then_is_abandoned() {
    use tollway_server::quota::IDLE_REPORTS;
    let file = File::new("rlqs-idle", &limits(""));
    let (running, grpc, _) = start(&file.0).await;
    let mut a = Envoy::connect(grpc).await;
    let mut b = Envoy::connect(grpc).await;
    assert_eq!(rate(a.report(&[("k", 1, 0, 0)]).await["k"]), 98);
    // Nothing for b yet, and nothing said: an Envoy that reconnected would keep what it
    // has, while its old stream's share may be in force.
    assert_eq!(b.report(&[("k", 1, 0, 0)]).await["k"], Told::Nothing);
    // Quiet: a keeps what b's demand leaves, evenly divided, for a minute.
    assert_eq!(
        b.report(&[("k", 0, 300, 5)]).await["k"],
        Told::Nothing,
        "a holds it"
    );
    assert_eq!(rate(a.report(&[("k", 0, 0, 5)]).await["k"]), 19);
    assert_eq!(rate(b.report(&[("k", 0, 300, 5)]).await["k"]), 79);
    for _ in 1..IDLE_REPORTS - 1 {
        assert_eq!(rate(a.report(&[("k", 0, 0, 5)]).await["k"]), 19);
    }
    assert_eq!(a.report(&[("k", 0, 0, 5)]).await["k"], Told::Abandon);
    assert_eq!(rate(b.report(&[("k", 300, 0, 5)]).await["k"]), 98);
    let told = a.report(&[("internal-7", 1, 0, 0)]).await;
    assert_eq!(told["internal-7"], Told::Allow);
    running.stop().await;
    // A policy in shadow mode refuses nothing.
    let shadow = limits("").replace("period = \"1s\"", "period = \"1s\"\nshadow = true");
    let file = File::new("rlqs-shadow", &shadow);
    let (running, grpc, _) = start(&file.0).await;
    let mut envoy = Envoy::connect(grpc).await;
    assert_eq!(envoy.report(&[("k", 1, 0, 0)]).await["k"], Told::Allow);
    running.stop().await;
}

// A reload that drops the rule abandons the bucket on the open stream; one that changes
// the limit assigns anew, without a report.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_reassigns_or_abandons_on_open_streams() {
    let file = File::new("rlqs-reload", &limits(""));
    let (running, grpc, _) = start(&file.0).await;
    let mut envoy = Envoy::connect(grpc).await;
    assert_eq!(rate(envoy.report(&[("k", 1, 0, 0)]).await["k"]), 98);
    std::fs::write(&file.0, limits("").replace("limit = 100", "limit = 640")).unwrap();
    running.reload().await.unwrap();
    let answer = tokio::time::timeout(Duration::from_secs(10), envoy.answers.message())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(rate(told(&answer)["k"]), 630);
    let without = limits("");
    let without = &without[..without.find("[[buckets]]").unwrap()];
    std::fs::write(&file.0, without).unwrap();
    running.reload().await.unwrap();
    let answer = tokio::time::timeout(Duration::from_secs(10), envoy.answers.message())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(told(&answer)["k"], Told::Abandon);
    running.stop().await;
}

// gRPC health names the quota service as it names RLS. A stream of more buckets than it
// keeps gives the quietest's place to each new one (that bucket is abandoned), and keeps
// serving the busy ones. A bucket id past a descriptor's bounds is abandoned alone: the
// stream goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_names_the_service_and_a_stream_keeps_its_bound() {
    use tollway_server::quota::MAX_BUCKETS;
    let file = File::new("rlqs-bounds", &limits(""));
    let (running, grpc, _) = start(&file.0).await;
    assert!(running.probe().await, "the store answers");
    assert_eq!(shared::health(grpc, RLQS).await, "Serving");
    let mut envoy = Envoy::connect(grpc).await;
    let busy = envoy.report(&[("busy", 1, 0, 0)]).await["busy"];
    assert_eq!(busy, Told::Bucket(98, 13));
    // Busy for a report: the quietest is never this one.
    assert!(rate(envoy.report(&[("busy", 400, 0, 5)]).await["busy"]) > 0);
    let keys: Vec<String> = (0..MAX_BUCKETS).map(|i| format!("key-{i}")).collect();
    let usages: Vec<(&str, u64, u64, i64)> = keys.iter().map(|k| (k.as_str(), 1, 0, 0)).collect();
    let told = envoy.report(&usages).await;
    assert_eq!(told.0.len(), MAX_BUCKETS, "every new bucket answered");
    let given_up: Vec<&String> = told
        .0
        .iter()
        .filter(|(_, t)| **t == Told::Abandon)
        .map(|(k, _)| k)
        .collect();
    assert_eq!(given_up.len(), 1, "{given_up:?}");
    assert_ne!(given_up[0], "busy", "the busy bucket keeps its place");
    assert_ne!(told[keys[MAX_BUCKETS - 1].as_str()], Told::Abandon);
    assert!(rate(envoy.report(&[("busy", 400, 0, 5)]).await["busy"]) > 0);
    // A bucket id past a descriptor's bounds: abandoned, unread by the store; the stream
    // and its other buckets go on.
    let long = "v".repeat(tollway_server::bounds::VALUE_BYTES + 1);
    let told = envoy
        .report(&[(long.as_str(), 1, 0, 0), ("busy", 400, 0, 5)])
        .await;
    assert_eq!(told[long.as_str()], Told::Abandon);
    assert!(rate(told["busy"]) > 0);
    let counted = super::metrics().render();
    for line in [
        "tollway_rls_requests_refused_total{reason=\"value_bytes\"}",
        "tollway_rlqs_buckets_abandoned_total{reason=\"evicted\"}",
        "tollway_rlqs_buckets_abandoned_total{reason=\"bounds\"}",
    ] {
        assert!(counted.contains(line), "{line} in {counted}");
    }
    running.stop().await;
}

// What a report says is bounded: a count of 2^64 - 1 requests is taken as 2^32 - 1, so
// the reported-requests counter moves by at most that much a report and never wraps.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reported_count_cannot_wrap_the_counter() {
    use tollway_server::quota::MAX_REPORTED;
    // A policy of its own: no other test's reports move its counter.
    let file = File::new("rlqs-counts", &limits("").replace("per_key", "counted"));
    let (running, grpc, _) = start(&file.0).await;
    let mut envoy = Envoy::connect(grpc).await;
    let counted = || {
        super::metrics()
            .render()
            .lines()
            .find(|l| {
                l.starts_with("tollway_rlqs_reported_requests_total{")
                    && l.contains("outcome=\"allowed\"")
                    && l.contains("policy=\"counted\"")
            })
            .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    let _ = envoy.report(&[("huge", 1, 0, 0)]).await;
    let before = counted();
    let _ = envoy.report(&[("huge", u64::MAX, 0, 5)]).await;
    let after = counted();
    assert!(after > before, "{before} then {after}");
    assert!(
        after - before <= MAX_REPORTED as f64,
        "{before} then {after}: moved past {MAX_REPORTED}"
    );
    drop(envoy);
    running.stop().await;
}
