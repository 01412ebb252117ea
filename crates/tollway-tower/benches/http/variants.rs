//! The variants: what each server puts in front of the same handler.

use axum::Router;
use axum::body::Body;
use axum::routing::get;
use tollway_core::{Algorithm, MemoryStore, Policy, Quota, RedisStore};
use tollway_tower::{HeaderStyle, OnStoreError, RateLimitLayer};
use tower_governor::GovernorLayer;
use tower_governor::governor::GovernorConfigBuilder;

use crate::BoxError;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Variant {
    Axum,
    Tollway,
    Governor,
    TollwayRejecting,
    GovernorRejecting,
    TollwayNoHeaders,
    GovernorHeaders,
    RedisHealthy,
    RedisDead,
    RedisFloodCached,
    RedisFloodUncached,
    NoopLayer,
    TollwayOutside,
    HeadersOnly,
    TollwayShadow,
    TollwayShadowed,
    TollwayListener,
    TollwayMetrics,
    TollwayConfig,
}

impl Variant {
    /// Every variant; the first ten are the default suite.
    pub(crate) const ALL: [Variant; 19] = [
        Variant::Axum,
        Variant::Tollway,
        Variant::Governor,
        Variant::TollwayRejecting,
        Variant::GovernorRejecting,
        Variant::TollwayNoHeaders,
        Variant::GovernorHeaders,
        Variant::NoopLayer,
        Variant::TollwayOutside,
        Variant::HeadersOnly,
        Variant::RedisHealthy,
        Variant::RedisDead,
        Variant::RedisFloodCached,
        Variant::RedisFloodUncached,
        Variant::TollwayShadow,
        Variant::TollwayShadowed,
        Variant::TollwayListener,
        Variant::TollwayMetrics,
        Variant::TollwayConfig,
    ];

    /// The variants of the operating suite (`HTTP_BENCH_SUITE=operate`): what shadow
    /// mode, a listener and metrics cost beside the plain layer. `tollway-metrics` needs
    /// the bench built with `--features metrics`.
    pub(crate) const OPERATE: [Variant; 8] = [
        Variant::Tollway,
        Variant::TollwayConfig,
        Variant::TollwayRejecting,
        Variant::TollwayNoHeaders,
        Variant::TollwayShadow,
        Variant::TollwayShadowed,
        Variant::TollwayListener,
        Variant::TollwayMetrics,
    ];

    /// The variants of the fleet suite (`HTTP_BENCH_SUITE=fleet`).
    pub(crate) const FLEET: [Variant; 6] = [
        Variant::Axum,
        Variant::Tollway,
        Variant::RedisHealthy,
        Variant::RedisDead,
        Variant::RedisFloodCached,
        Variant::RedisFloodUncached,
    ];

    pub(crate) fn needs_redis(self) -> bool {
        matches!(
            self,
            Variant::RedisHealthy
                | Variant::RedisDead
                | Variant::RedisFloodCached
                | Variant::RedisFloodUncached
        )
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            Variant::Axum => "axum (no limiter)",
            Variant::Tollway => "tollway, allowed",
            Variant::Governor => "tower_governor, allowed",
            Variant::TollwayRejecting => "tollway, all 429",
            Variant::GovernorRejecting => "tower_governor, all 429",
            Variant::TollwayNoHeaders => "tollway, no headers",
            Variant::GovernorHeaders => "tower_governor, headers",
            Variant::RedisHealthy => "tollway+Redis, allowed",
            Variant::RedisDead => "tollway+Redis dead, breaker",
            Variant::RedisFloodCached => "Redis, flood, deny cache",
            Variant::RedisFloodUncached => "Redis, flood, no cache",
            Variant::NoopLayer => "axum + a no-op layer",
            Variant::TollwayOutside => "tollway around Router",
            Variant::HeadersOnly => "axum + 3 constant headers",
            Variant::TollwayShadow => "tollway, shadow mode",
            Variant::TollwayShadowed => "tollway, shadow, all over",
            Variant::TollwayListener => "tollway, no-op listener",
            Variant::TollwayMetrics => "tollway, Prometheus metrics",
            Variant::TollwayConfig => "tollway from a limits file",
        }
    }

    pub(crate) fn expected_status(self) -> u16 {
        match self {
            Variant::TollwayRejecting
            | Variant::GovernorRejecting
            | Variant::RedisFloodCached
            | Variant::RedisFloodUncached => 429,
            _ => 200,
        }
    }

    /// The name `HTTP_BENCH_ONLY` selects it by.
    pub(crate) fn short(self) -> &'static str {
        match self {
            Variant::Axum => "axum",
            Variant::Tollway => "tollway",
            Variant::Governor => "governor",
            Variant::TollwayRejecting => "tollway-429",
            Variant::GovernorRejecting => "governor-429",
            Variant::TollwayNoHeaders => "tollway-bare",
            Variant::GovernorHeaders => "governor-headers",
            Variant::RedisHealthy => "redis",
            Variant::RedisDead => "redis-dead",
            Variant::RedisFloodCached => "redis-flood",
            Variant::RedisFloodUncached => "redis-flood-nocache",
            Variant::NoopLayer => "noop",
            Variant::TollwayOutside => "tollway-outside",
            Variant::HeadersOnly => "headers-only",
            Variant::TollwayShadow => "tollway-shadow",
            Variant::TollwayShadowed => "tollway-shadowed",
            Variant::TollwayListener => "tollway-listener",
            Variant::TollwayMetrics => "tollway-metrics",
            Variant::TollwayConfig => "tollway-config",
        }
    }

    pub(crate) fn index(self) -> usize {
        Variant::ALL.iter().position(|v| *v == self).unwrap_or(0)
    }
}

pub(crate) async fn hello() -> &'static str {
    "Hello, World!"
}

/// The Redis-backed stores of the fleet suite, connected on the server's runtime.
pub(crate) struct Fleet {
    /// Allowed traffic: every decision is a script call.
    pub(crate) healthy: RedisStore,
    /// One key over its limit, with the local deny cache (the default).
    pub(crate) cached: RedisStore,
    /// The same without the cache: every denial is a script call.
    pub(crate) uncached: RedisStore,
    /// A store whose server has been killed, behind a breaker that is open.
    pub(crate) dead: RedisStore,
}

/// A quota nothing in this benchmark reaches: a million a second, a burst of a billion.
pub(crate) fn huge_quota() -> Result<Quota, BoxError> {
    Ok(Quota::per_second(1_000_000)?.with_burst(1_000_000_000)?)
}

/// tollway over a memory store: GCRA at `quota`, peer-IP keys, `headers`.
pub(crate) fn memory_layer(
    quota: Quota,
    headers: HeaderStyle,
) -> Result<RateLimitLayer<MemoryStore>, BoxError> {
    let policy = Policy::new("bench", Algorithm::Gcra, quota)?;
    Ok(RateLimitLayer::builder(MemoryStore::new(), policy)
        .headers(headers)
        .build()?)
}

/// The router of one variant.
pub(crate) fn app(variant: Variant, fleet: Option<&Fleet>) -> Result<Router, BoxError> {
    let router = Router::new().route("/", get(hello));
    Ok(match variant {
        // tollway-outside wraps this router where it is served.
        Variant::Axum | Variant::TollwayOutside => router,
        Variant::NoopLayer => router.layer(tower::util::MapRequestLayer::new(
            |request: axum::extract::Request| request,
        )),
        // The floor of any layer that adds tollway's three headers: no key, no decision,
        // no clock, values made once.
        Variant::HeadersOnly => router.layer(tower::util::MapResponseLayer::new(
            |mut response: axum::response::Response| {
                let headers = response.headers_mut();
                headers.insert(
                    tollway_tower::X_RATELIMIT_LIMIT.clone(),
                    http::HeaderValue::from_static("1000000000"),
                );
                headers.insert(
                    tollway_tower::X_RATELIMIT_REMAINING.clone(),
                    http::HeaderValue::from_static("999999999"),
                );
                headers.insert(
                    tollway_tower::X_RATELIMIT_RESET.clone(),
                    http::HeaderValue::from_static("1764583200"),
                );
                response
            },
        )),
        Variant::Tollway => router.layer(memory_layer(huge_quota()?, HeaderStyle::Legacy)?),
        Variant::TollwayNoHeaders => router.layer(memory_layer(huge_quota()?, HeaderStyle::None)?),
        Variant::TollwayRejecting => {
            router.layer(memory_layer(Quota::per_hour(1)?, HeaderStyle::Legacy)?)
        }
        Variant::TollwayShadow => {
            let layer = memory_layer(huge_quota()?, HeaderStyle::Legacy)?;
            layer.set_shadow(true);
            router.layer(layer)
        }
        Variant::TollwayShadowed => {
            let layer = memory_layer(Quota::per_hour(1)?, HeaderStyle::Legacy)?;
            layer.set_shadow(true);
            router.layer(layer)
        }
        Variant::TollwayListener => {
            let policy = Policy::new("bench", Algorithm::Gcra, huge_quota()?)?;
            router.layer(
                RateLimitLayer::builder(MemoryStore::new(), policy)
                    .on_decision(|_: &tollway_tower::DecisionEvent<'_>| {})
                    .build()?,
            )
        }
        Variant::TollwayConfig => {
            // The `tollway` variant's limits, from a file, with a reloader behind them.
            let text = "[layer]\ndefault = \"bench\"\nheaders = \"legacy\"\n\n\
                        [policies.bench]\nalgorithm = \"gcra\"\nlimit = 1_000_000\n\
                        period = \"1s\"\nburst = 1_000_000_000\n";
            let file = tollway_tower::config::LimitsFile::parse("bench.toml", text)?;
            let reloader =
                tollway_tower::config::Reloader::from_file("bench.toml", file, MemoryStore::new())?;
            router.layer(reloader.layer())
        }
        Variant::TollwayMetrics => {
            install_metrics_recorder()?;
            router.layer(memory_layer(huge_quota()?, HeaderStyle::Legacy)?)
        }
        Variant::Governor => {
            let config = GovernorConfigBuilder::default()
                .per_nanosecond(1_000)
                .burst_size(1_000_000_000)
                .finish()
                .ok_or("tower_governor rejected the allowed-path quota")?;
            router.layer(GovernorLayer::<_, _, Body>::new(config))
        }
        Variant::GovernorHeaders => {
            let config = GovernorConfigBuilder::default()
                .per_nanosecond(1_000)
                .burst_size(1_000_000_000)
                .use_headers()
                .finish()
                .ok_or("tower_governor rejected the allowed-path quota")?;
            router.layer(GovernorLayer::<_, _, Body>::new(config))
        }
        Variant::GovernorRejecting => {
            let config = GovernorConfigBuilder::default()
                .per_second(3600)
                .burst_size(1)
                .finish()
                .ok_or("tower_governor rejected the 1-per-hour quota")?;
            router.layer(GovernorLayer::<_, _, Body>::new(config))
        }
        Variant::RedisHealthy
        | Variant::RedisDead
        | Variant::RedisFloodCached
        | Variant::RedisFloodUncached => {
            let fleet = fleet.ok_or("the fleet variants need their Redis stores")?;
            let allowed = Policy::new("bench", Algorithm::Gcra, huge_quota()?)?;
            let flood = Policy::new("flood", Algorithm::Gcra, Quota::per_hour(1)?)?;
            match variant {
                Variant::RedisHealthy => {
                    router.layer(RateLimitLayer::builder(fleet.healthy.clone(), allowed).build()?)
                }
                Variant::RedisDead => router.layer(
                    RateLimitLayer::builder(fleet.dead.clone(), allowed)
                        .on_store_error(OnStoreError::Allow)
                        .build()?,
                ),
                Variant::RedisFloodCached => {
                    router.layer(RateLimitLayer::builder(fleet.cached.clone(), flood).build()?)
                }
                _ => router.layer(RateLimitLayer::builder(fleet.uncached.clone(), flood).build()?),
            }
        }
    })
}

/// Records metrics into `metrics-exporter-prometheus`, as a service that exports them.
#[cfg(feature = "metrics")]
pub(crate) fn install_metrics_recorder() -> Result<(), BoxError> {
    metrics_exporter_prometheus::PrometheusBuilder::new().install_recorder()?;
    Ok(())
}

#[cfg(not(feature = "metrics"))]
pub(crate) fn install_metrics_recorder() -> Result<(), BoxError> {
    Err("tollway-metrics needs the bench built with --features metrics".into())
}
