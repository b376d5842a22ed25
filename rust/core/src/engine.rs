//! The messenger engine: a data directory plus an instance name, publishing
//! envelopes through the channel writers.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::SystemTime;

use crate::envelope::{
    self, encode_record, format_ts, new_id, validate_name, Header, NameKind, MAX_RECORD_BYTES,
};
use crate::storage::{ChannelWriter, LogReader, Store, StoreConfig};
use crate::Error;

/// One message to publish; the payload is already compact JSON.
#[derive(Debug, Clone, Copy)]
pub struct Outgoing<'a> {
    pub payload_type: &'a str,
    pub payload_json: &'a [u8],
    pub service_name: Option<&'a str>,
    pub correlation_id: Option<&'a str>,
}

/// Result of a publish: the message id and where its record starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Published {
    pub id: String,
    pub offset: u64,
}

/// A local messenger instance: storage plus identity.
pub struct Engine {
    store: Store,
    origin: String,
    closed: AtomicBool,
}

impl Engine {
    /// Opens the data directory of `cfg` for the instance `origin`.
    pub fn open(cfg: StoreConfig, origin: &str) -> Result<Engine, Error> {
        if origin.is_empty() {
            return Err(Error::Config("instance name must not be empty".into()));
        }
        Ok(Engine {
            store: Store::open(cfg)?,
            origin: origin.to_owned(),
            closed: AtomicBool::new(false),
        })
    }

    /// The instance name written as `origin`.
    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// The underlying store.
    pub fn store(&self) -> &Store {
        &self.store
    }

    fn check_open(&self) -> Result<(), Error> {
        if self.closed.load(Ordering::Acquire) {
            Err(Error::Closed("messenger is closed".into()))
        } else {
            Ok(())
        }
    }

    /// The writer of a channel callers may publish to.
    pub fn publish_writer(&self, channel: &str) -> Result<Arc<ChannelWriter>, Error> {
        self.check_open()?;
        validate_name(NameKind::PublishChannel, channel)?;
        Ok(self.store.writer(channel)?)
    }

    /// Appends one message envelope to `out` and returns its id; refuses
    /// records over the size limit.
    pub fn encode(&self, out: &mut Vec<u8>, channel: &str, m: &Outgoing<'_>) -> Result<String, Error> {
        let id = new_id();
        let ts = format_ts(SystemTime::now());
        let before = out.len();
        encode_record(
            out,
            &Header {
                id: &id,
                ts: &ts,
                channel,
                origin: &self.origin,
                payload_type: m.payload_type,
                correlation_id: m.correlation_id,
                service_name: m.service_name,
            },
            m.payload_json,
        );
        let size = out.len() - before;
        if size > MAX_RECORD_BYTES {
            out.truncate(before);
            return Err(Error::TooLarge {
                size,
                limit: MAX_RECORD_BYTES,
            });
        }
        Ok(id)
    }

    /// Publishes one message and returns once it is committed.
    pub fn publish(&self, channel: &str, m: &Outgoing<'_>) -> Result<Published, Error> {
        let writer = self.publish_writer(channel)?;
        let mut line = Vec::with_capacity(200 + m.payload_json.len());
        let id = self.encode(&mut line, channel, m)?;
        let at = writer.append(&line, 1)?;
        Ok(Published { id, offset: at.offset })
    }

    /// Publishes several messages as one group: one write, one fsync, all or
    /// none committed, contiguous in one segment.
    pub fn publish_batch(&self, channel: &str, items: &[Outgoing<'_>]) -> Result<Vec<Published>, Error> {
        let writer = self.publish_writer(channel)?;
        if items.is_empty() {
            return Ok(Vec::new());
        }
        let mut buf = Vec::with_capacity(items.iter().map(|m| 200 + m.payload_json.len()).sum());
        let mut ids = Vec::with_capacity(items.len());
        for m in items {
            let start = buf.len();
            ids.push((self.encode(&mut buf, channel, m)?, start as u64));
        }
        let at = writer.append(&buf, items.len() as u64)?;
        Ok(ids
            .into_iter()
            .map(|(id, rel)| Published {
                id,
                offset: at.offset + rel,
            })
            .collect())
    }

    /// A reader of `channel` from global offset `from`, and the limit up to
    /// which it may read (the committed end).
    pub fn reader(&self, channel: &str, from: u64) -> Result<(LogReader, Arc<ChannelWriter>), Error> {
        self.check_open()?;
        validate_name(NameKind::Channel, channel)?;
        let writer = self.store.writer(channel)?;
        Ok((LogReader::new(writer.dir(), from), writer))
    }

    /// Stops publishing, flushes and closes every channel. Idempotent.
    pub fn close(&self) {
        self.closed.store(true, Ordering::Release);
        self.store.close();
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.close();
    }
}

/// A reader over a channel of any data directory, including one written by
/// keyop-messenger 1.4 or by another process (no lock is taken).
pub fn read_channel(data_dir: &Path, channel: &str, from: u64) -> Result<LogReader, Error> {
    envelope::validate_name(NameKind::Channel, channel)?;
    Ok(LogReader::new(crate::storage::channel_dir(data_dir, channel), from))
}
