//! The `[store]` section: a memory store, or a Redis store with the `redis` feature.

use tollway_core::{BoxStore, ConfigError, MemoryStore};
use toml::Spanned;

use super::LimitsFile;
use super::schema::StoreSection;

/// The store a file describes, ready to build.
enum StoreBuilder {
    Memory(tollway_core::MemoryStoreBuilder),
    #[cfg(feature = "redis")]
    Redis(tollway_core::RedisStoreBuilder),
}

/// What a file naming Redis gets without the `redis` feature.
#[cfg(not(feature = "redis"))]
pub(super) const NEEDS_REDIS: &str = "kind = \"redis\" needs tollway-tower's `redis` feature, \
     which this build does not have: enable it (features = [\"config\", \"redis\"]), or \
     write kind = \"memory\"";

/// What a file asking for leases gets without the `leases` feature.
#[cfg(not(feature = "leases"))]
const NEEDS_LEASES: &str = "leases need tollway-tower's `leases` feature, which this build \
     does not have: enable it (features = [\"config\", \"redis\", \"leases\"]), or remove leases";

const REDIS_WHERE: &str = "a Redis store has one of url = \"redis://host:6379\", nodes = [...] for a cluster, or sentinel = { master = \"name\", nodes = [...] }";

impl LimitsFile {
    /// Whether the file has a `[store]` section (without one, [`store`](Self::store) is
    /// a memory store).
    #[must_use]
    pub fn has_store(&self) -> bool {
        self.file.store.is_some()
    }

    /// The store the file describes, connected: a memory store with its bound, or a
    /// Redis store (standalone at `url`, or a cluster of `nodes`) with its settings.
    ///
    /// # Errors
    ///
    /// When Redis cannot be reached or refuses the settings.
    pub async fn store(&self) -> Result<BoxStore, ConfigError> {
        let span = self.file.store.as_ref().map(Spanned::span);
        match self.store_builder()? {
            StoreBuilder::Memory(memory) => {
                let store = memory.build().map_err(|e| self.err(span, e))?;
                Ok(BoxStore::new(store))
            }
            #[cfg(feature = "redis")]
            StoreBuilder::Redis(builder) => {
                let section = self.file.store.as_ref().map(Spanned::get_ref);
                let section = section.ok_or_else(|| self.at(span.clone(), REDIS_WHERE))?;
                let connected = match (&section.url, &section.nodes, &section.sentinel) {
                    (Some(url), None, None) => builder.connect(url).await,
                    (None, Some(nodes), None) => {
                        let nodes: Vec<&str> = nodes.iter().map(String::as_str).collect();
                        builder.connect_cluster(&nodes).await
                    }
                    (None, None, Some(sentinel)) => {
                        builder.connect_sentinel(&self.sentinel(sentinel)?).await
                    }
                    _ => return Err(self.at(span.clone(), REDIS_WHERE)),
                };
                let store = connected.map_err(|e| self.at(span, &e.to_string()))?;
                self.leased(store)
            }
        }
    }

    /// The `[store.sentinel]` section as the store takes it.
    #[cfg(feature = "redis")]
    fn sentinel(
        &self,
        spanned: &Spanned<super::schema::SentinelSection>,
    ) -> Result<tollway_core::Sentinel, ConfigError> {
        let section = spanned.get_ref();
        if section.master.is_empty() || section.nodes.is_empty() {
            return Err(self.at(
                Some(spanned.span()),
                "sentinel needs master = \"<the name the sentinels monitor>\" and nodes = [\"redis://host:26379\", ...]",
            ));
        }
        let mut sentinel = tollway_core::Sentinel::new(&section.master, section.nodes.clone());
        if let Some(username) = &section.username {
            sentinel = sentinel.username(username);
        }
        if let Some(password) = &section.password {
            sentinel = sentinel.password(password);
        }
        if let Some(db) = section.db {
            sentinel = sentinel.db(db);
        }
        if section.tls == Some(true) {
            sentinel = sentinel.tls();
        }
        Ok(sentinel)
    }

    /// The Redis store as the file's `leases` say: itself, or leased from.
    #[cfg(feature = "redis")]
    fn leased(&self, store: tollway_core::RedisStore) -> Result<BoxStore, ConfigError> {
        #[cfg(feature = "leases")]
        if let Some(leases) = self.lease_builder(store.clone())? {
            return Ok(BoxStore::new(leases.build()?));
        }
        Ok(BoxStore::new(store))
    }

    /// The leases the `[store]` section asks for over `store`, checked; `None` for none.
    #[cfg(feature = "leases")]
    fn lease_builder<S: tollway_core::Store>(
        &self,
        store: S,
    ) -> Result<Option<tollway_core::LeasedBuilder<S>>, ConfigError> {
        use super::schema::Switch;

        let section = self.file.store.as_ref().map(Spanned::get_ref);
        let Some(leases) = section.and_then(|s| s.leases.as_ref()) else {
            return Ok(None);
        };
        let mut builder = tollway_core::Leased::builder(store);
        match leases.get_ref() {
            Switch::Toggle(false) => return Ok(None),
            Switch::Toggle(true) => {}
            Switch::Set(set) => {
                if let Some(ms) = set.horizon_ms {
                    builder = builder.horizon(std::time::Duration::from_millis(ms));
                }
                if let Some(units) = set.min_units {
                    builder = builder.min_units(units);
                }
                if let Some(share) = set.max_share {
                    builder = builder.max_share(share);
                }
            }
        }
        Ok(Some(builder))
    }

    /// The `leases` setting, checked: only on a Redis store, and only with the `leases`
    /// feature.
    fn check_leases(&self, section: &StoreSection, redis: bool) -> Result<(), ConfigError> {
        let Some(leases) = &section.leases else {
            return Ok(());
        };
        if !redis {
            return Err(self.at(
                Some(leases.span()),
                "leases are taken from a shared store: they need kind = \"redis\" (a memory store decides every request here already)",
            ));
        }
        #[cfg(feature = "leases")]
        if let Some(builder) = self.lease_builder(MemoryStore::new())? {
            builder
                .build()
                .map_err(|e| self.err(Some(leases.span()), e))?;
        }
        #[cfg(not(feature = "leases"))]
        return Err(self.at(Some(leases.span()), NEEDS_LEASES));
        #[cfg(feature = "leases")]
        Ok(())
    }

    /// The builder of the store the file describes, its settings checked.
    fn store_builder(&self) -> Result<StoreBuilder, ConfigError> {
        let Some(spanned) = &self.file.store else {
            return Ok(StoreBuilder::Memory(MemoryStore::builder()));
        };
        let section = spanned.get_ref();
        let kind = section
            .kind
            .as_ref()
            .map_or("memory", |k| k.get_ref().as_str());
        if kind == "memory" {
            let mut builder = MemoryStore::builder();
            if let Some(max) = &section.max_keys {
                builder = builder.max_keys(*max.get_ref());
                // The bound's own check, now rather than at start.
                builder
                    .clone()
                    .build()
                    .map_err(|e| self.err(Some(max.span()), e))?;
            }
            return Ok(StoreBuilder::Memory(builder));
        }
        self.redis_builder(spanned)
    }

    /// The Redis store's builder, its settings checked.
    #[cfg(feature = "redis")]
    fn redis_builder(&self, spanned: &Spanned<StoreSection>) -> Result<StoreBuilder, ConfigError> {
        use std::time::Duration;

        use super::schema::Switch;

        let section = spanned.get_ref();
        let mut builder = tollway_core::RedisStore::builder();
        if let Some(prefix) = &section.prefix {
            builder = builder.prefix(prefix.clone());
        }
        if let Some(ms) = section.timeout_ms {
            builder = builder.timeout(Duration::from_millis(ms));
        }
        match section.stall_after_ms {
            Some(0) => builder = builder.without_stall_detection(),
            Some(ms) => builder = builder.stall_after(Duration::from_millis(ms)),
            None => {}
        }
        match section.breaker.as_ref().map(Spanned::get_ref) {
            Some(Switch::Toggle(false)) => builder = builder.without_breaker(),
            Some(Switch::Set(b)) => {
                builder = builder.breaker(
                    b.threshold.unwrap_or(5),
                    Duration::from_millis(b.cool_down_ms.unwrap_or(250)),
                );
            }
            Some(Switch::Toggle(true)) | None => {}
        }
        match section.local_fallback.as_ref().map(Spanned::get_ref) {
            Some(Switch::Toggle(false)) => builder = builder.without_local_fallback(),
            Some(Switch::Set(share)) => builder = builder.local_fallback(*share),
            Some(Switch::Toggle(true)) | None => {}
        }
        builder
            .validate()
            .map_err(|e| self.err(Some(spanned.span()), e))?;
        Ok(StoreBuilder::Redis(builder))
    }

    /// Without the `redis` feature, a file naming Redis is refused at its `kind`.
    #[cfg(not(feature = "redis"))]
    fn redis_builder(&self, spanned: &Spanned<StoreSection>) -> Result<StoreBuilder, ConfigError> {
        let kind = spanned.get_ref().kind.as_ref();
        Err(self.at(
            Some(kind.map_or_else(|| spanned.span(), Spanned::span)),
            NEEDS_REDIS,
        ))
    }

    pub(super) fn check_store(&self) -> Result<(), ConfigError> {
        let Some(spanned) = &self.file.store else {
            return Ok(());
        };
        self.check_store_kind(spanned)?;
        let section = spanned.get_ref();
        let redis = section
            .kind
            .as_ref()
            .is_some_and(|k| k.get_ref() == "redis");
        self.check_leases(section, redis)?;
        self.store_builder().map(|_| ())
    }

    fn check_store_kind(&self, spanned: &Spanned<StoreSection>) -> Result<(), ConfigError> {
        let section = spanned.get_ref();
        let kind = section.kind.as_ref();
        let wheres = [
            section.url.is_some(),
            section.nodes.is_some(),
            section.sentinel.is_some(),
        ]
        .iter()
        .filter(|&&given| given)
        .count();
        match (kind.map(|k| k.get_ref().as_str()), wheres) {
            (None | Some("memory"), 0) => Ok(()),
            (Some("redis"), 1) => {
                #[cfg(feature = "redis")]
                if let Some(sentinel) = &section.sentinel {
                    self.sentinel(sentinel)?;
                }
                Ok(())
            }
            (Some("redis"), _) => Err(self.at(Some(spanned.span()), REDIS_WHERE)),
            (None | Some("memory"), _) => Err(self.at(
                Some(spanned.span()),
                "a memory store has no url, nodes or sentinel: write kind = \"redis\" to use Redis",
            )),
            (Some(_), _) => Err(kind.map_or_else(
                || ConfigError::new("unreachable"),
                |k| self.choice(k, "kind", &["memory", "redis"]),
            )),
        }
    }
}
