//! What an idempotency layer was built with: [`Config`], shared by the
//! layer, its services and their futures and tasks, with its defaults.
//! Below every engine of this folder: they import it, it imports only the
//! data types (`flight.rs`, `feed.rs`, `seal.rs`'s key).

use std::sync::Arc;
use std::time::Duration;

use http::header::{self, HeaderName};
use http::HeaderMap;
use http::StatusCode;

use super::feed::Feed;
use super::flight::Flights;
use super::seal::SealKey;
use crate::backend::idempotency::Quota;
use crate::backend::IdempotencyBackend;
use crate::retry_after::HoldTimes;
use crate::settings::Settings;
use crate::stats::Counters;
use crate::stats::IdempotencyOutcome;

/// Default retention of a completed record: 24 h.
pub(crate) const DEFAULT_RETENTION: Duration = Duration::from_secs(24 * 60 * 60);
/// Default claim (in-flight lease) time to live: 30 s.
pub(crate) const DEFAULT_TTL: Duration = Duration::from_secs(30);
/// Default share of the store of one scope (identity and route): 1,000
/// entries, and no new claim once its records hold 1 MiB.
pub(crate) const DEFAULT_QUOTA: Quota = Quota {
    entries: 1_000,
    bytes: 1024 * 1024,
};

/// The layer's feed of published outcomes: started on the first joining
/// request, started again after it closed (at most once per
/// [`FEED_RETRY`] after a failure, so that a refused subscription does not
/// cost every joining request a round trip).
#[derive(Debug, Default)]
pub(crate) struct FeedSlot {
    pub(crate) current: std::sync::Mutex<Option<Arc<Feed>>>,
    /// Held while a feed is being started.
    pub(crate) starting: tokio::sync::Mutex<Option<tokio::time::Instant>>,
    /// Whether the missing feed was logged (once per layer).
    pub(crate) warned: std::sync::atomic::AtomicBool,
}

/// Least time between two attempts to start a feed after one failed.
pub(crate) const FEED_RETRY: Duration = Duration::from_secs(5);

/// Default largest response body kept in a record: 64 KiB.
pub(crate) const DEFAULT_RECORD_LIMIT: usize = 64 * 1024;

/// The response headers kept by default: `content-type`, `content-encoding`,
/// `content-language`, `content-location`, `location`, `etag`,
/// `last-modified`, `cache-control`, `vary` (what a cache must be told
/// again: a `no-store, private` answer replayed without it could be kept by
/// a shared cache). Anything else (cookies, dates, tracing ids, hop-by-hop
/// headers) is not replayed unless you add it.
pub(crate) const DEFAULT_STORED_HEADERS: [HeaderName; 9] = [
    header::CONTENT_TYPE,
    header::CONTENT_ENCODING,
    header::CONTENT_LANGUAGE,
    header::CONTENT_LOCATION,
    header::LOCATION,
    header::ETAG,
    header::LAST_MODIFIED,
    header::CACHE_CONTROL,
    header::VARY,
];

/// The default rule for which responses are stored: every final status
/// except 409 and 429.
///
/// Once the handler began, its outcome is recorded whatever it is, 5xx
/// included: the layer cannot tell "failed before charging" from "charged,
/// then failed", and only the second must never run twice (Stripe records
/// 500s the same way once execution began; the IETF draft leaves ambiguous
/// outcomes to the server). A handler that knows nothing happened marks its
/// response [`SafeToRetry`](super::SafeToRetry) and the key is freed. 409
/// (a conflict that may clear) and 429 (rate limited) are transient by
/// nature, so a retry runs again. 408 is stored: the layer's own 408 (the
/// body did not arrive) comes before any claim, so a 408 from below is a
/// timeout that cut a handler that may have charged. 1xx never reach a
/// layer.
pub(crate) fn default_store_when(status: StatusCode) -> bool {
    !status.is_informational() && !matches!(status.as_u16(), 409 | 429)
}

type StorePredicate = Arc<dyn Fn(StatusCode) -> bool + Send + Sync>;
type SkipPredicate = Arc<dyn Fn(&http::request::Parts) -> bool + Send + Sync>;

/// Configuration shared by a layer, its services and their futures.
#[derive(Clone)]
pub(crate) struct Config {
    /// What both layers have (key, key space, TTL, deadline, body limits,
    /// responder).
    pub(crate) settings: Settings,
    /// What seals this layer's records: derived from `settings.key_space`
    /// (and set with it).
    pub(crate) seal_key: SealKey,
    /// Where claims and records are kept. Called through the `dyn`
    /// (`config.store.as_ref().claim(..)`): a call on the `Arc` itself would
    /// take the blanket `IdempotencyBackend for Arc<T>`, one more hop
    /// through `backend/idempotency.rs` on every store call.
    pub(crate) store: Arc<dyn IdempotencyBackend>,
    /// A request without an `Idempotency-Key` is 400 (else the key parts
    /// and the fingerprint stand in for it).
    pub(crate) require_key: bool,
    /// The request headers that are part of the fingerprint.
    pub(crate) fingerprint_headers: Vec<HeaderName>,
    /// The response headers a record keeps (and a replay may carry).
    pub(crate) stored_headers: Vec<HeaderName>,
    /// The largest response body a record keeps.
    pub(crate) record_limit: usize,
    /// How long a record is kept.
    pub(crate) retention: Duration,
    /// Which statuses are recorded (the others free the key).
    pub(crate) store_when: StorePredicate,
    /// Which requests go to the handler untouched (no key, no claim, no
    /// record); `None`: none.
    pub(crate) skip_when: Option<SkipPredicate>,
    /// How long a duplicate waits for the request in flight (zero: 409 at
    /// once).
    pub(crate) join_timeout: Duration,
    /// The requests in flight in this process, which local duplicates join.
    pub(crate) flights: Arc<Flights>,
    /// What the store publishes to waiting duplicates, started on the
    /// first joining request.
    pub(crate) feed: Arc<FeedSlot>,
    /// One scope's share of the store.
    pub(crate) quota: Quota,
    /// When a scope over its quota was last logged at WARN (once a minute).
    pub(crate) quota_warned: Arc<std::sync::Mutex<Option<tokio::time::Instant>>>,
    /// How long this layer's recent requests ran (claim to record), for an
    /// honest `Retry-After` on the 409 of a duplicate in flight.
    pub(crate) holds: Arc<HoldTimes>,
    /// What the layer counts.
    pub(crate) stats: Counters<IdempotencyOutcome>,
}

impl Config {
    /// The headers (or trailers) of `headers` that this layer stores (and
    /// replays): the configured ones, and for a gRPC answer (`grpc`) the
    /// protocol's own (`content-type`, `grpc-status`, `grpc-message`,
    /// `grpc-status-details-bin`, `grpc-encoding`), without which a replay
    /// is no gRPC answer.
    pub(crate) fn stored(&self, headers: &HeaderMap, grpc: bool) -> HeaderMap {
        let mut out = HeaderMap::new();
        let protocol = match grpc {
            true => &crate::wire::grpc::PROTOCOL_HEADERS[..],
            false => &[],
        };
        let configured = self.stored_headers.iter();
        let names = configured.chain(protocol.iter().filter(|p| !self.stored_headers.contains(p)));
        for name in names {
            for value in headers.get_all(name) {
                out.append(name.clone(), value.clone());
            }
        }
        out
    }
}
