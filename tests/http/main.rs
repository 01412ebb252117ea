//! The rate-limiting layer end to end: a real axum server on 127.0.0.1:0, a real HTTP
//! client over TCP, the memory store and a real `redis-server`, on a manual clock so that
//! every header value is exact.
//!
//! Most tests run twice, as `<test>::memory` and `<test>::redis`: the same body over a
//! `MemoryStore` and over a `RedisStore` in caller-time mode (on this binary's shared
//! server, under a key prefix of its own), both reading the one manual clock that the
//! layer also reads for `X-RateLimit-Reset`. Shaping is tested at the service, on a
//! paused clock; what a dead Redis gets is in the faults binary.

#![allow(clippy::unwrap_used)]

mod extractors;
mod fleet;
mod headers;
mod keys;
mod limits;
mod shaping;
