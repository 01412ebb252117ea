//! The response body of a rate-limited service: the service's own, or the layer's answer.

use std::pin::Pin;
use std::task::{Context, Poll};

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
    #[derive(Debug)]
    pub struct ResponseBody<B> {
        #[pin]
        inner: Inner<B>,
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

impl<B> ResponseBody<B> {
    /// The inner service's body.
    pub(crate) fn service(body: B) -> Self {
        ResponseBody {
            inner: Inner::Service { body },
        }
    }

    /// The layer's own answer.
    pub(crate) fn layer(bytes: Bytes) -> Self {
        ResponseBody {
            inner: Inner::Layer {
                body: Full::new(bytes),
            },
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
        match self.project().inner.project() {
            InnerProj::Service { body } => body.poll_frame(cx),
            InnerProj::Layer { body } => Pin::new(body)
                .poll_frame(cx)
                .map_err(|never| match never {}),
        }
    }

    fn is_end_stream(&self) -> bool {
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
