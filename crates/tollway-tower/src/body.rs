//! The response body of a rate-limited service: the service's own, or the layer's answer.

use std::fmt;
use std::pin::Pin;
use std::sync::Mutex;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::Full;
use pin_project_lite::pin_project;

pin_project! {
    /// The body of a [`RateLimit`](crate::RateLimit) service's response.
    ///
    /// It is the inner service's body when the request was let through. It is the layer's
    /// own bytes when the layer answered: a 429's JSON, or a gRPC status's empty body.
    ///
    /// It is a [`Body`] whenever the inner service's is, with the same error type, so it
    /// fits any framework's body bound: axum's `IntoResponse`, tonic's server, hyper.
    ///
    /// When the layer settles a call after its response
    /// ([`settle`](crate::RateLimitLayerBuilder::settle)), the body settles it at its
    /// end, before it hands on its last frame. Dropped before its end, it settles at once.
    pub struct ResponseBody<B> {
        #[pin]
        inner: Inner<B>,
        end: Option<End>,
    }
}

pin_project! {
    #[project = InnerProj]
    #[derive(Debug)]
    enum Inner<B> {
        Service { #[pin] body: B },
        Layer { body: Full<Bytes> },
    }
}

/// Work left when a response ends: settling a reservation, say. The body polls it to
/// the end before it ends. Dropped before its end, it does what it can at once.
pub(crate) trait Finish: Send {
    /// Does the work; `Ready` once it is done.
    fn poll_finish(&mut self, cx: &mut Context<'_>) -> Poll<()>;
}

/// Work to finish at the body's end, and the last frame, held while it runs.
struct End {
    // In a mutex only so that the body stays `Sync` when the service's is; it is
    // reached through `get_mut`, never locked.
    work: Mutex<Box<dyn Finish>>,
    /// Whether the body has ended and the work is running.
    ending: bool,
    /// The last frame, handed on once the work is done.
    last: Option<Frame<Bytes>>,
}

impl End {
    fn poll_work(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        let work = self
            .work
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        work.poll_finish(cx)
    }
}

impl<B: fmt::Debug> fmt::Debug for ResponseBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseBody")
            .field("inner", &self.inner)
            .field("finishing", &self.end.is_some())
            .finish()
    }
}

impl<B> ResponseBody<B> {
    /// The inner service's body.
    pub(crate) fn service(body: B) -> Self {
        ResponseBody {
            inner: Inner::Service { body },
            end: None,
        }
    }

    /// The inner service's body, which does `work` when it ends.
    pub(crate) fn finishing(body: B, work: Box<dyn Finish>) -> Self {
        ResponseBody {
            inner: Inner::Service { body },
            end: Some(End {
                work: Mutex::new(work),
                ending: false,
                last: None,
            }),
        }
    }

    /// The layer's own answer.
    pub(crate) fn layer(bytes: Bytes) -> Self {
        ResponseBody {
            inner: Inner::Layer {
                body: Full::new(bytes),
            },
            end: None,
        }
    }
}

impl<B> Body for ResponseBody<B>
where
    B: Body<Data = Bytes>,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let mut this = self.project();
        loop {
            if let Some(end) = this.end.as_mut()
                && end.ending
            {
                ready!(end.poll_work(cx));
                let last = end.last.take();
                *this.end = None;
                return Poll::Ready(last.map(Ok));
            }
            let (frame, ended) = match this.inner.as_mut().project() {
                InnerProj::Service { mut body } => {
                    let frame = ready!(body.as_mut().poll_frame(cx));
                    (frame, body.is_end_stream())
                }
                InnerProj::Layer { body } => {
                    return Pin::new(body)
                        .poll_frame(cx)
                        .map_err(|never| match never {});
                }
            };
            let Some(end) = this.end.as_mut() else {
                return Poll::Ready(frame);
            };
            match frame {
                None => end.ending = true,
                Some(Ok(frame)) if ended => {
                    end.ending = true;
                    end.last = Some(frame);
                }
                Some(Ok(frame)) => return Poll::Ready(Some(Ok(frame))),
                // A broken body ends the call short: its work is done on drop.
                Some(Err(error)) => {
                    *this.end = None;
                    return Poll::Ready(Some(Err(error)));
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        // A body with work left is polled to its end, so that the work is done first.
        if self.end.is_some() {
            return false;
        }
        match &self.inner {
            Inner::Service { body } => body.is_end_stream(),
            Inner::Layer { body } => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.inner {
            Inner::Service { body } => body.size_hint(),
            Inner::Layer { body } => body.size_hint(),
        }
    }
}

#[cfg(test)]
mod tests {
    use http_body_util::BodyExt;

    use super::*;

    #[tokio::test]
    async fn the_layers_bytes_are_one_whole_frame() {
        let body = ResponseBody::<Full<Bytes>>::layer(Bytes::from_static(b"{\"error\":1}"));
        assert_eq!(body.size_hint().exact(), Some(11));
        assert!(!body.is_end_stream());
        let bytes = body.collect().await.unwrap().to_bytes();
        assert_eq!(&bytes[..], b"{\"error\":1}");
    }

    #[tokio::test]
    async fn the_services_body_passes_through() {
        let body = ResponseBody::service(Full::new(Bytes::from_static(b"hello")));
        assert_eq!(body.size_hint().exact(), Some(5));
        assert_eq!(&body.collect().await.unwrap().to_bytes()[..], b"hello");
        let empty = ResponseBody::service(http_body_util::Empty::<Bytes>::new());
        assert!(empty.is_end_stream());
    }
}
