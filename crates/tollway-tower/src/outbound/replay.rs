//! Which requests are sent again after an upstream's 429.

use http::{Method, Request};

/// Chooses the requests an [`Outbound`](super::Outbound) service sends once more.
///
/// It applies after the upstream refused them with a 429 (or `RESOURCE_EXHAUSTED`). It
/// makes the copy to send, before the first is sent. Or it answers `None` for a request
/// that must not go twice.
///
/// The built-in choices are [`Idempotent`] (the default) and [`NoReplay`]; any
/// `Fn(&Request<B>) -> Option<Request<B>>` is one too, say to send a `POST` again that
/// carries an idempotency key.
///
/// # Examples
///
/// ```
/// use http::{Method, Request};
/// use tollway_tower::outbound::{Idempotent, NoReplay, Replay};
///
/// let get = Request::get("https://api.example.com/v1/charges").body(String::new()).unwrap();
/// let post = Request::post("https://api.example.com/v1/charges")
///     .header("idempotency-key", "order-7")
///     .body("{}".to_owned())
///     .unwrap();
///
/// assert!(Idempotent.replay(&get).is_some());
/// assert!(Idempotent.replay(&post).is_none());
/// assert!(NoReplay.replay(&get).is_none());
///
/// // A POST that carries an idempotency key may go twice as well.
/// let keyed = |request: &Request<String>| {
///     if request.method() != Method::POST || !request.headers().contains_key("idempotency-key") {
///         return Idempotent.replay(request);
///     }
///     let mut copy = Request::new(request.body().clone());
///     *copy.method_mut() = Method::POST;
///     *copy.uri_mut() = request.uri().clone();
///     *copy.headers_mut() = request.headers().clone();
///     Some(copy)
/// };
/// assert!(keyed.replay(&post).is_some());
/// ```
pub trait Replay<B> {
    /// A copy of `request` to send if the upstream refuses it, or `None`.
    fn replay(&self, request: &Request<B>) -> Option<Request<B>>;
}

impl<B, F> Replay<B> for F
where
    F: Fn(&Request<B>) -> Option<Request<B>>,
{
    fn replay(&self, request: &Request<B>) -> Option<Request<B>> {
        self(request)
    }
}

/// Sends a refused request again when its method is idempotent (`GET`, `HEAD`, `PUT`,
/// `DELETE`, `OPTIONS`, `TRACE`: RFC 9110, section 9.2.2), copying its method, URI,
/// version, headers and body. Extensions are not copied. The body must be `Clone`
/// (`Empty`, `Full<Bytes>`, `String`, `Bytes`…); with a streaming body, choose
/// [`NoReplay`] or a closure.
#[derive(Clone, Copy, Debug, Default)]
pub struct Idempotent;

impl<B: Clone> Replay<B> for Idempotent {
    fn replay(&self, request: &Request<B>) -> Option<Request<B>> {
        let idempotent = matches!(
            *request.method(),
            Method::GET
                | Method::HEAD
                | Method::PUT
                | Method::DELETE
                | Method::OPTIONS
                | Method::TRACE
        );
        idempotent.then(|| {
            let mut copy = Request::new(request.body().clone());
            *copy.method_mut() = request.method().clone();
            *copy.uri_mut() = request.uri().clone();
            *copy.version_mut() = request.version();
            *copy.headers_mut() = request.headers().clone();
            copy
        })
    }
}

/// Never sends a request again: a refusal is handed to the caller.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoReplay;

impl<B> Replay<B> for NoReplay {
    fn replay(&self, _request: &Request<B>) -> Option<Request<B>> {
        None
    }
}
