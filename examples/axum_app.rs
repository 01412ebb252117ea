//! The `axum_server` example's application, shared with its end-to-end tests: the
//! limited API with its limits from `examples/tollway.toml`, `GET /metrics`, and the admin
//! API behind a token.
//!
//! | route | what |
//! |---|---|
//! | `GET /` | hello, limited by the caller's tier |
//! | `GET`/`POST /api/v1/checkout` | also 5 / min per caller (sliding window log) |
//! | `POST /api/v1/completions?tokens=N` | also 1,000 tokens / min per caller, settled after the response to the `N` it reports used |
//! | `GET /metrics` | Prometheus text |
//! | `GET /admin/limits/{policy}/{key}` | a caller's state under a policy (`all`: each), consuming nothing |
//! | `DELETE /admin/limits/{policy}/{key}` | the caller back to fresh under that policy (`all`: every one) |
//! | `PUT /admin/shadow/{policy}` (body `on` / `off`, or `file` to follow the file again; `all`: the whole layer) | shadow mode, kept over reloads |
//! | `GET /admin/shed` | the load shedder: its limit, calls in flight, and by priority what it admitted, refused and (in shadow mode) would have refused |
//! | `PUT /admin/shed/shadow` (body `on` / `off`) | the load shedder's shadow mode |
//! | `GET /admin/config` | the live limits file (its SHA-256, when loaded), the reloads that worked and failed, each limit's shadow mode |
//! | `POST /admin/reload` | the limits file read again (it is also watched): what changed |
//! | `GET /lab` | the live lab: the seven algorithms, each limiting `/lab/api/{algorithm}` (see `lab.rs`) |
//!
//! The API routes are behind the file's load shedder (`[shed]`): when the service is
//! full, it answers 503 with `Retry-After` before any caller's limit is asked. Pro keys
//! are refused last, then free keys, then guests' orders (`POST /api/v1/checkout`), and
//! anonymous browsing first.
//!
//! `{key}` is the caller's key as the store sees it: `ip:203.0.113.9`, `key:demo-free-key`.
//! The admin routes exist only when an admin token is given ([`Doors::admin_token`]);
//! they want `Authorization: Bearer <token>` (none is 401, another is 403) and are
//! limited to [`ADMIN_PER_MINUTE`] requests a minute per address, right or wrong, by a
//! tollway layer on a memory store of their own. The lab is mounted only when
//! [`Doors::lab`] says so, on a memory store of its own: it never touches `store`.
//! `demo-partner-key` is on the allow list (never limited), `demo-banned-key` on the deny
//! list (403).

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use metrics_exporter_prometheus::PrometheusHandle;
use serde_json::json;
use tollway_tower::config::{ConfigKey, LimitsFile, Reloader};
use tollway_tower::{
    Algorithm, BoxStore, ConfigError, MemoryStore, Operation, PeerIp, Policy, Quota,
    RateLimitLayer, ShadowState, Store, StoreError,
};
use tower_http::timeout::RequestBodyTimeoutLayer;

/// The example's layer: limits from its file, keys by API key, else the peer address.
pub type Limits = RateLimitLayer<BoxStore, ConfigKey>;

/// The header a completion reports the tokens it used in.
pub const TOKENS_USED: &str = "x-tokens-used";

/// How long a request body may take to arrive: a call waiting longer for its client
/// ends, and gives its place in the load shedder back.
pub const BODY_TIMEOUT: Duration = Duration::from_secs(10);

/// How many admin requests an address may make a minute (a token bucket): a guess at
/// the token costs one.
pub const ADMIN_PER_MINUTE: u64 = 30;

/// Which of the example's doors are open.
#[derive(Clone, Default)]
pub struct Doors {
    /// The admin API's bearer token; `None`: no admin routes at all.
    pub admin_token: Option<String>,
    /// Whether `/lab` is mounted (on a memory store of its own).
    pub lab: bool,
    /// Host names besides `localhost` and IP addresses the lab and `/metrics` answer
    /// at (see [`crate::guard`]).
    pub hosts: Vec<String>,
}

impl std::fmt::Debug for Doors {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the token itself.
        f.debug_struct("Doors")
            .field("admin_token", &self.admin_token.as_ref().map(|_| "<set>"))
            .field("lab", &self.lab)
            .field("hosts", &self.hosts)
            .finish()
    }
}

/// The example's limits file, `examples/tollway.toml`.
pub const DEFAULT_CONFIG: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tollway.toml");

/// The example's application over `store`, its limits from the file at `config`: the
/// limited API, `/metrics` from `metrics`, and the admin API and the lab if `doors`
/// open them. Also returns its reloader (to watch the file, or reload it by hand).
///
/// # Errors
///
/// When the limits file cannot be read or is not valid.
pub fn app(
    config: &std::path::Path,
    store: BoxStore,
    metrics: PrometheusHandle,
    doors: &Doors,
) -> Result<(Router, Reloader<BoxStore>), ConfigError> {
    let file = LimitsFile::read(config)?;
    // What a file cannot say: how many tokens a completion used.
    let reloader = Reloader::from_file_with(config, file, store, |builder| {
        builder.settle("tokens", |_, headers, _| {
            headers.get(TOKENS_USED)?.to_str().ok()?.parse().ok()
        })
    })?;
    let limits = reloader.layer();

    let api = Router::new()
        .route("/", get(hello))
        .route("/api/v1/checkout", get(checkout_status).post(place_order))
        .route("/api/v1/completions", post(complete))
        .layer(limits.clone())
        // A body not sent within 10 s ends its call, and its place in the load shedder.
        .layer(RequestBodyTimeoutLayer::new(BODY_TIMEOUT));
    let admin = Arc::new(Admin {
        limits,
        reloader: reloader.clone(),
        token: doors.admin_token.clone().unwrap_or_default(),
        metrics,
    });
    // Added after the layer, so not limited by it.
    // `/metrics` at our own names only: a rebinding page cannot read it.
    let guard = crate::guard::Guard::new(&doors.hosts, "");
    let mut router = Router::new().route(
        "/metrics",
        get(render_metrics).layer(axum::middleware::from_fn_with_state(
            guard,
            crate::guard::guard,
        )),
    );
    if doors.admin_token.is_some() {
        // Limited before the token is looked at: guesses cost the guesser.
        let guesses = Policy::new(
            "admin",
            Algorithm::TokenBucket,
            Quota::per_minute(ADMIN_PER_MINUTE)?,
        )?;
        let limited = RateLimitLayer::builder(MemoryStore::new(), guesses)
            .key(PeerIp::new())
            .build()?;
        let routes = Router::new()
            .route(
                "/admin/limits/{policy}/{key}",
                get(peek_limit).delete(reset_limit),
            )
            .route("/admin/shadow/{policy}", put(set_shadow))
            .route("/admin/shed", get(shed_state))
            .route("/admin/shed/shadow", put(set_shed_shadow))
            .route("/admin/config", get(live_config))
            .route("/admin/reload", post(reload))
            .layer(limited);
        router = router.merge(routes);
    }
    let mut router = api.merge(router.with_state(admin));
    if doors.lab {
        // The lab: its own limits, one an algorithm, on a memory store of its own, so
        // that it can never touch (nor evict) the callers' keys in `store`.
        router = router.merge(crate::lab::router(MemoryStore::new(), &doors.hosts)?);
    }
    Ok((router, reloader))
}

struct Admin {
    limits: Limits,
    reloader: Reloader<BoxStore>,
    token: String,
    metrics: PrometheusHandle,
}

/// Reads the limits file again (what a SIGHUP would do): 200 with what changed (the new
/// version, the policies whose counts start afresh, the run-time shadow switches kept
/// over the file), or 422 with the file's error, the running limits kept.
async fn reload(State(admin): State<Arc<Admin>>, headers: HeaderMap) -> Response {
    if let Some(refusal) = refuse(&admin, &headers) {
        return refusal;
    }
    match admin.reloader.reload().await {
        Ok(reloaded) => json_response(
            StatusCode::OK,
            &json!({
                "version": reloaded.version(),
                "reset_policies": reloaded.reset_policies(),
                "kept_switches": shadow_json(reloaded.kept_switches()),
            }),
        ),
        Err(e) => error(StatusCode::UNPROCESSABLE_ENTITY, &e.to_string()),
    }
}

/// The live configuration: which file (its SHA-256 and when it was loaded), how its
/// reloads went, and each limit's shadow mode (`switched`: by `PUT /admin/shadow`, over
/// what the file says).
async fn live_config(State(admin): State<Arc<Admin>>, headers: HeaderMap) -> Response {
    if let Some(refusal) = refuse(&admin, &headers) {
        return refusal;
    }
    let live = admin.reloader.live();
    let loaded_at = live
        .loaded_at()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    json_response(
        StatusCode::OK,
        &json!({
            "version": live.version(),
            "loaded_at_unix": loaded_at.as_secs(),
            "reloads": live.reloads(),
            "reload_failures": live.failures(),
            "last_error": live.last_error(),
            "pending": live.pending(),
            "shadow": shadow_json(&admin.limits.shadow_states()),
        }),
    )
}

/// Shadow states as JSON: `policy` (`all` for the whole layer), `on`, `switched`.
fn shadow_json(states: &[ShadowState]) -> serde_json::Value {
    states
        .iter()
        .map(|state| {
            json!({
                "policy": state.policy().unwrap_or("all"),
                "on": state.is_on(),
                "switched": state.is_switched(),
            })
        })
        .collect()
}

async fn hello() -> &'static str {
    "Hello from behind tollway!\n"
}

async fn checkout_status() -> &'static str {
    "Checkout is open.\n"
}

async fn place_order() -> &'static str {
    "Order placed.\n"
}

#[derive(serde::Deserialize)]
struct Completion {
    #[serde(default)]
    tokens: u32,
}

/// A pretend model call that used `?tokens=N` tokens, and says so in `X-Tokens-Used`.
async fn complete(Query(completion): Query<Completion>) -> impl IntoResponse {
    (
        [(TOKENS_USED, completion.tokens.to_string())],
        "A completion.\n",
    )
}

async fn render_metrics(State(admin): State<Arc<Admin>>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        admin.metrics.render(),
    )
}

async fn peek_limit(
    State(admin): State<Arc<Admin>>,
    headers: HeaderMap,
    Path((policy, key)): Path<(String, String)>,
) -> Response {
    operate(&admin, &headers, &policy, &key, Operation::Peek(0)).await
}

async fn reset_limit(
    State(admin): State<Arc<Admin>>,
    headers: HeaderMap,
    Path((policy, key)): Path<(String, String)>,
) -> Response {
    operate(&admin, &headers, &policy, &key, Operation::Reset).await
}

/// Carries out `operation` on `key` under `policy` and answers the state after it, with
/// whether a request would pass now.
async fn operate(
    admin: &Admin,
    headers: &HeaderMap,
    policy: &str,
    key: &str,
    operation: Operation,
) -> Response {
    if let Some(refusal) = refuse(admin, headers) {
        return refusal;
    }
    let all = admin.limits.policies();
    let policies: Vec<&Policy> = match policy {
        "all" => all.iter().collect(),
        name => match all.iter().find(|p| p.name() == name) {
            Some(policy) => vec![policy],
            None => {
                let known: Vec<&str> = all.iter().map(Policy::name).collect();
                let message =
                    format!("no policy {name:?}; the policies are {known:?}, or say `all`");
                return error(StatusCode::NOT_FOUND, &message);
            }
        },
    };
    let store = admin.limits.store();
    let key = key.as_bytes();
    // One policy at a time: a peek at several would be all or nothing.
    let mut described = Vec::new();
    for policy in policies {
        match state_after(&store, key, policy, operation).await {
            Ok(mut state) => {
                state["policy"] = json!(policy.name());
                state["key"] = json!(String::from_utf8_lossy(key));
                described.push(state);
            }
            Err(e) => return error(StatusCode::SERVICE_UNAVAILABLE, &e.to_string()),
        }
    }
    match <[_; 1]>::try_from(described) {
        Ok([one]) => json_response(StatusCode::OK, &one),
        Err(all) => json_response(StatusCode::OK, &serde_json::Value::Array(all)),
    }
}

/// `key`'s state under `policy` after `operation` (a peek, a reset...), and whether its
/// next request would pass: what the admin API and the lab show.
pub(crate) async fn state_after(
    store: &BoxStore,
    key: &[u8],
    policy: &Policy,
    operation: Operation,
) -> Result<serde_json::Value, StoreError> {
    let state = store.operate(key, &[policy], operation).await?;
    let next = store.operate(key, &[policy], Operation::Peek(1)).await?;
    let (now, next) = (&state[0], &next[0]);
    Ok(json!({
        "limit": now.limit(),
        "remaining": now.remaining(),
        "reset_after_ms": now.reset_after().as_millis() as u64,
        "next_request_allowed": next.is_allowed(),
        "retry_after_ms": next.retry_after().map(|wait| wait.as_millis() as u64),
    }))
}

async fn set_shadow(
    State(admin): State<Arc<Admin>>,
    headers: HeaderMap,
    Path(policy): Path<String>,
    body: Bytes,
) -> Response {
    if let Some(refusal) = refuse(&admin, &headers) {
        return refusal;
    }
    let limits = &admin.limits;
    let on = match body.trim_ascii() {
        b"on" => Some(true),
        b"off" => Some(false),
        b"file" => None,
        _ => return error(StatusCode::BAD_REQUEST, "send `on`, `off` or `file`"),
    };
    let set = match (policy.as_str(), on) {
        ("all", Some(on)) => {
            limits.set_shadow(on);
            Ok(())
        }
        // Every switch dropped: each limit as the file says.
        ("all", None) => {
            limits.reset_shadow();
            Ok(())
        }
        (name, Some(on)) => limits.set_policy_shadow(name, on),
        // This policy as the file says: what it would be without its switch.
        (name, None) => match limits
            .shadow_states()
            .iter()
            .find(|state| state.policy() == Some(name))
        {
            Some(state) => limits.set_policy_shadow(name, state.is_on() != state.is_switched()),
            None => limits.set_policy_shadow(name, false),
        },
    };
    match set {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => error(StatusCode::NOT_FOUND, &e.to_string()),
    }
}

/// The load shedder as it stands; 404 when the file has no `[shed]`.
async fn shed_state(State(admin): State<Arc<Admin>>, headers: HeaderMap) -> Response {
    if let Some(refusal) = refuse(&admin, &headers) {
        return refusal;
    }
    let Some(shed) = admin.limits.shed() else {
        return error(StatusCode::NOT_FOUND, "the limits file has no [shed]");
    };
    let priorities: Vec<_> = shed
        .priorities()
        .iter()
        .map(|p| {
            json!({
                "name": p.name,
                "share": p.share,
                "in_flight": p.in_flight,
                "admitted": p.admitted,
                "shed": p.shed,
                "would_shed": p.would_shed,
            })
        })
        .collect();
    let state = json!({
        "limit": shed.limit(),
        "in_flight": shed.in_flight(),
        "shadow": shed.is_shadow(),
        "priorities": priorities,
    });
    json_response(StatusCode::OK, &state)
}

/// Puts the load shedder in shadow mode (`on`) or takes it out (`off`).
async fn set_shed_shadow(
    State(admin): State<Arc<Admin>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if let Some(refusal) = refuse(&admin, &headers) {
        return refusal;
    }
    let Some(shed) = admin.limits.shed() else {
        return error(StatusCode::NOT_FOUND, "the limits file has no [shed]");
    };
    match body.trim_ascii() {
        b"on" => shed.set_shadow(true),
        b"off" => shed.set_shadow(false),
        _ => return error(StatusCode::BAD_REQUEST, "send `on` or `off`"),
    }
    StatusCode::NO_CONTENT.into_response()
}

/// The refusal of an admin request: 401 without a bearer token, 403 with another than
/// the admin's; `None` for the admin.
fn refuse(admin: &Admin, headers: &HeaderMap) -> Option<Response> {
    let Some(given) = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.as_bytes().strip_prefix(b"Bearer "))
    else {
        let mut response = error(
            StatusCode::UNAUTHORIZED,
            "send Authorization: Bearer <admin token>",
        );
        response
            .headers_mut()
            .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        return Some(response);
    };
    (!same(given, admin.token.as_bytes()))
        .then(|| error(StatusCode::FORBIDDEN, "that is not the admin token"))
}

/// Whether `given` is `token`, in time that depends on the length of `given` only: not
/// on where they differ, nor on the token's length.
fn same(given: &[u8], token: &[u8]) -> bool {
    if token.is_empty() {
        return false;
    }
    let differ = given
        .iter()
        .enumerate()
        .fold(0u8, |acc, (i, x)| acc | (x ^ token[i % token.len()]));
    differ == 0 && given.len() == token.len()
}

fn error(status: StatusCode, message: &str) -> Response {
    let reason = status.canonical_reason().unwrap_or("Error");
    json_response(status, &json!({ "error": reason, "message": message }))
}

fn json_response(status: StatusCode, body: &serde_json::Value) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}
