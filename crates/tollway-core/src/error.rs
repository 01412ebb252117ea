//! Errors: bad configuration, and a store that could not answer.

use std::borrow::Cow;
use std::error::Error;
use std::fmt;

/// A quota or policy that cannot work, found when it is built.
///
/// The message is a sentence that says what to change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    message: Cow<'static, str>,
}

impl ConfigError {
    /// A configuration error with a message that says what to change (for crates that
    /// build on tollway-core and validate their own settings).
    pub fn new(message: impl Into<Cow<'static, str>>) -> Self {
        ConfigError {
            message: message.into(),
        }
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl Error for ConfigError {}

/// What kind of failure a [`StoreError`] is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum StoreErrorKind {
    /// The store did not answer within its timeout.
    Timeout,
    /// No connection: refused, reset, closed, or none to be had from a pool.
    Connection,
    /// The store answered, but not with a decision: a script error, a protocol error, a
    /// reply of the wrong shape.
    Script,
    /// Anything else (a breaker that is open, a configuration a store refused at run time).
    Other,
}

/// A store could not decide: the backend failed, timed out or answered nonsense.
///
/// What a caller does with it (let the request through, reject it, ask a local limiter)
/// is the caller's policy; the store only reports, with the [`kind`](Self::kind) of
/// failure.
#[derive(Debug)]
pub struct StoreError {
    kind: StoreErrorKind,
    message: Cow<'static, str>,
    source: Option<Box<dyn Error + Send + Sync>>,
}

impl StoreError {
    /// A store error of `kind` with a message.
    pub fn new(kind: StoreErrorKind, message: impl Into<Cow<'static, str>>) -> Self {
        StoreError {
            kind,
            message: message.into(),
            source: None,
        }
    }

    /// A store error of `kind` with a message and the error that caused it.
    pub fn with_source(
        kind: StoreErrorKind,
        message: impl Into<Cow<'static, str>>,
        source: impl Into<Box<dyn Error + Send + Sync>>,
    ) -> Self {
        StoreError {
            kind,
            message: message.into(),
            source: Some(source.into()),
        }
    }

    /// What kind of failure this is.
    #[must_use]
    pub fn kind(&self) -> StoreErrorKind {
        self.kind
    }
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl Error for StoreError {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        self.source.as_deref().map(|e| e as &(dyn Error + 'static))
    }
}
