//! keyop-core: the storage and delivery engine of keyop-messenger.
//!
//! Pure Rust, no Python. The disk format is that of keyop-messenger 1.4
//! (segment files of JSON-lines envelopes); see `envelope` and `storage`.

pub mod audit;
pub mod columns;
pub mod dedup;
pub mod engine;
pub mod envelope;
pub mod federation;
pub mod fork;
pub mod gateway;
pub mod keygen;
pub mod lograte;
pub mod memtrim;
pub mod replay;
pub mod stats;
pub mod storage;
pub mod subscribe;

pub use engine::{
    frame_batch, frame_rows, read_channel, read_channel_stats, resolve_position, Engine, Framed,
    FramedIds, Outgoing, Published, Submitted,
};
pub use envelope::{Envelope, EnvelopeRef, NameError, NameKind};
pub use storage::compaction::{CompactionReport, RetentionConfig, RetentionLimits};
pub use storage::timeindex::StartPosition;
pub use storage::{StorageError, StoreConfig};
pub use subscribe::{BatchOutcome, Delivery, Failure, Handler, SubscribeOptions, Subscriber};

/// Errors of the engine's public operations. The Python binding maps each
/// variant onto one exception class.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    InvalidName(#[from] NameError),
    #[error("message is {size} bytes encoded; the limit is {limit} bytes")]
    TooLarge { size: usize, limit: usize },
    /// A record breaks the rules of a valid record (envelope.rs): nothing was written.
    #[error(transparent)]
    InvalidRecord(crate::envelope::RecordError),
    #[error("{0}")]
    Closed(String),
    #[error("{0}")]
    Config(String),
    #[error("{0}")]
    Subscription(String),
    #[error("federation: {0}")]
    Federation(String),
    #[error("{0}")]
    ConnectionLost(String),
    #[error("{0}")]
    BufferFull(String),
    /// A hub refused a record (allowlist, size, validity); it was not stored.
    #[error("{0}")]
    Policy(String),
    /// The object was opened in another process (before a fork).
    #[error("{0}")]
    Forked(String),
    /// Data a reader was positioned on is gone; nothing was skipped.
    #[error("{0}")]
    DataLoss(String),
    /// A bounded wait ran out; the message says what was pending.
    #[error("{0}")]
    Timeout(String),
    #[error(transparent)]
    Storage(StorageError),
}

impl From<crate::envelope::RecordError> for Error {
    fn from(e: crate::envelope::RecordError) -> Error {
        match e {
            crate::envelope::RecordError::TooLarge { size, limit } => {
                Error::TooLarge { size, limit }
            }
            other => Error::InvalidRecord(other),
        }
    }
}

impl From<StorageError> for Error {
    fn from(e: StorageError) -> Error {
        match e {
            StorageError::Name(n) => Error::InvalidName(n),
            StorageError::Closed(c) => Error::Closed(format!("channel {c:?} is closed")),
            other => Error::Storage(other),
        }
    }
}
