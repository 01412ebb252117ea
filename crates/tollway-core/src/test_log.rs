//! A tracing subscriber for tests: the level of each event at `info` and above, and the
//! value of one of its fields.

use std::fmt;
use std::sync::Arc;

use parking_lot::Mutex;

/// Keeps each event's level and its `field` (empty when it has none).
#[derive(Clone)]
pub(crate) struct Lines {
    field: &'static str,
    pub(crate) seen: Arc<Mutex<Vec<(tracing::Level, String)>>>,
}

impl Lines {
    pub(crate) fn of(field: &'static str) -> Self {
        Lines {
            field,
            seen: Arc::default(),
        }
    }
}

struct Field(&'static str, String);

impl tracing::field::Visit for Field {
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        if field.name() == self.0 {
            value.clone_into(&mut self.1);
        }
    }
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn fmt::Debug) {
        if field.name() == self.0 {
            self.1 = format!("{value:?}");
        }
    }
}

impl tracing::Subscriber for Lines {
    fn enabled(&self, metadata: &tracing::Metadata<'_>) -> bool {
        *metadata.level() <= tracing::Level::INFO
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, event: &tracing::Event<'_>) {
        let mut field = Field(self.field, String::new());
        event.record(&mut field);
        self.seen.lock().push((*event.metadata().level(), field.1));
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}
