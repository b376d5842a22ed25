//! Channel storage: the data directory, segment files, the per-channel writer
//! with group commit, and readers.

pub mod compaction;
pub mod fdpool;
pub mod offsets;
pub mod quarantine;
pub mod reader;
pub mod segment;
pub mod testhook;
pub mod timeindex;
pub mod writer;

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::Duration;

pub use reader::{Item, LogReader};
pub use writer::{
    AfterBatch, Appended, ChannelWriter, CommitNotifier, CounterSnapshot, FaultPoint, Ticket,
    WriterConfig,
};

use crate::envelope::{validate_name, NameError, NameKind};

/// Errors of the storage layer.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StorageError {
    /// An I/O step failed; `context` says which and for what.
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: Arc<io::Error>,
    },
    /// The channel's writer (or the store) was closed.
    #[error("channel {0:?} is closed")]
    Closed(String),
    /// Another messenger holds the data directory.
    #[error(
        "data directory {0} is in use by another messenger (its lock file is held); \
         close that messenger or use a different storage.data_dir"
    )]
    Locked(PathBuf),
    /// A name that would become a path was refused.
    #[error(transparent)]
    Name(#[from] NameError),
    /// A reader was pointed at a data directory that does not exist.
    #[error("data directory {0} does not exist (only opening a messenger creates one)")]
    DataDirNotFound(PathBuf),
    /// A reader was pointed at a channel that does not exist.
    #[error("channel {channel:?} does not exist in data directory {data_dir}")]
    ChannelNotFound { data_dir: PathBuf, channel: String },
}

impl StorageError {
    /// The OS error number behind an I/O failure, if any.
    pub fn raw_os_error(&self) -> Option<i32> {
        match self {
            StorageError::Io { source, .. } => source.raw_os_error(),
            _ => None,
        }
    }
}

/// Settings of a [`Store`].
#[derive(Debug, Clone)]
pub struct StoreConfig {
    pub data_dir: PathBuf,
    /// 0: every append is fdatasynced before it returns; N: a timer
    /// fdatasyncs every N ms and appends return after the write.
    pub sync_interval_ms: u64,
    /// Segment roll size in bytes; 0 never rolls.
    pub segment_bytes: u64,
}

/// Name of the lock file that keeps two messengers off one data directory.
pub const LOCK_FILE: &str = "keyop.lock";

struct Shared {
    cfg: StoreConfig,
    /// Looked up on every publish (a fast, randomly seeded hasher) and
    /// written only when a channel's writer is first opened: a read lock, so
    /// publishers look their writer up without excluding each other.
    writers: RwLock<HashMap<String, Arc<ChannelWriter>, foldhash::fast::RandomState>>,
    stop: Mutex<bool>,
    stop_cv: Condvar,
    /// Descriptor-pool owner of this store's segment files.
    owner: u64,
}

/// An open data directory: its layout, lock, and one writer per channel.
pub struct Store {
    shared: Arc<Shared>,
    syncer: Mutex<Option<JoinHandle<()>>>,
    /// Held (flock) while open; released by close.
    lock: Mutex<Option<File>>,
    /// Slot of the lock descriptor in [`crate::fork`]'s list: forked
    /// children let go of their copy at once (see [`crate::fork`]).
    lock_slot: Option<usize>,
    process: crate::fork::Owner,
}

fn io_err(context: String) -> impl FnOnce(io::Error) -> StorageError {
    move |e| StorageError::Io {
        context,
        source: Arc::new(e),
    }
}

impl Store {
    /// Opens (creating if needed) `data_dir` with its `channels/`,
    /// `subscribers/` and `audit/` directories, and takes its lock.
    pub fn open(cfg: StoreConfig) -> Result<Store, StorageError> {
        let root = &cfg.data_dir;
        fdpool::pool().refresh_capacity();
        for sub in ["channels", "subscribers", "audit"] {
            let dir = root.join(sub);
            segment::create_dir_all(&dir)
                .map_err(io_err(format!("cannot create directory {}", dir.display())))?;
        }
        let lock_path = root.join(LOCK_FILE);
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(|e| {
                let read_only = e.raw_os_error() == Some(libc::EROFS)
                    || e.kind() == io::ErrorKind::PermissionDenied;
                let context = if read_only {
                    format!(
                        "data directory {} is not writable (cannot open its lock file {}); \
                         a messenger needs to write there: make it writable, or read its \
                         channels with keyop_messenger.read_channel",
                        root.display(),
                        lock_path.display()
                    )
                } else {
                    format!("cannot open {}", lock_path.display())
                };
                io_err(context)(e)
            })?;
        // SAFETY: flock on a descriptor we own; no memory is shared.
        if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
                return Err(StorageError::Locked(root.clone()));
            }
            return Err(io_err(format!("cannot lock {}", lock_path.display()))(e));
        }
        // Torn tails left by a crash are cut now, not only when a channel is
        // next written, so no other reader of the directory meets them.
        for channel in compaction::list_channels(root).map_err(io_err(format!(
            "cannot list the channels of {}",
            root.display()
        )))? {
            let dir = channel_dir(root, &channel);
            segment::repair_channel(&dir).map_err(io_err(format!(
                "cannot recover channel {channel:?} in {}",
                dir.display()
            )))?;
        }
        quarantine::remove_stale_temporaries(root);
        let shared = Arc::new(Shared {
            cfg,
            writers: RwLock::new(HashMap::default()),
            stop: Mutex::new(false),
            stop_cv: Condvar::new(),
            owner: fdpool::pool().new_owner(),
        });
        let syncer = if shared.cfg.sync_interval_ms > 0 {
            let s = shared.clone();
            Some(
                std::thread::Builder::new()
                    .name("keyop-fsync".into())
                    .spawn(move || s.run_syncer())
                    .map_err(io_err("cannot start the fsync timer thread".into()))?,
            )
        } else {
            None
        };
        Ok(Store {
            shared,
            syncer: Mutex::new(syncer),
            lock_slot: crate::fork::register_lock_fd(lock.as_raw_fd()),
            lock: Mutex::new(Some(lock)),
            process: crate::fork::Owner::current(),
        })
    }

    /// Whether appends are fdatasynced before they return
    /// (`sync_interval_ms: 0`).
    pub fn durable(&self) -> bool {
        self.shared.cfg.sync_interval_ms == 0
    }

    /// The data directory.
    pub fn data_dir(&self) -> &Path {
        &self.shared.cfg.data_dir
    }

    /// Directory of `channel` (validated).
    pub fn channel_dir(&self, channel: &str) -> Result<PathBuf, StorageError> {
        validate_name(NameKind::Channel, channel)?;
        Ok(channel_dir(&self.shared.cfg.data_dir, channel))
    }

    /// The writer of `channel` if it is open and its map is free at once:
    /// never waits for another thread opening a writer.
    pub fn open_writer_now(&self, channel: &str) -> Option<Arc<ChannelWriter>> {
        self.shared.writers.try_read().ok()?.get(channel).cloned()
    }

    /// The writer of `channel`, opened (and recovered) on first use.
    pub fn writer(&self, channel: &str) -> Result<Arc<ChannelWriter>, StorageError> {
        let found = self
            .shared
            .writers
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(channel)
            .cloned();
        if let Some(w) = found {
            return Ok(w);
        }
        let mut writers = self
            .shared
            .writers
            .write()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(w) = writers.get(channel) {
            return Ok(w.clone());
        }
        if *self.shared.stop.lock().unwrap_or_else(|e| e.into_inner()) {
            return Err(StorageError::Closed(channel.to_owned()));
        }
        let dir = self.channel_dir(channel)?;
        let cfg = WriterConfig {
            segment_bytes: self.shared.cfg.segment_bytes,
            durable: self.shared.cfg.sync_interval_ms == 0,
        };
        let w = Arc::new(ChannelWriter::open_owned(
            channel,
            &dir,
            cfg,
            self.shared.owner,
        )?);
        writers.insert(channel.to_owned(), w.clone());
        Ok(w)
    }

    /// Writers opened so far.
    pub fn writers(&self) -> Vec<Arc<ChannelWriter>> {
        let writers = self
            .shared
            .writers
            .read()
            .unwrap_or_else(|e| e.into_inner());
        writers.values().cloned().collect()
    }

    /// Closes every writer (each syncs), stops the fsync timer and releases
    /// the data directory lock. Idempotent. In a forked child it does
    /// nothing: the files, lock and timer thread are the parent's.
    pub fn close(&self) {
        if self.process.is_foreign() {
            return;
        }
        *self.shared.stop.lock().unwrap_or_else(|e| e.into_inner()) = true;
        self.shared.stop_cv.notify_all();
        if let Some(t) = self.syncer.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = t.join();
        }
        for w in self.writers() {
            w.close();
        }
        // Segment files still held by readers of this store close now too.
        fdpool::pool().close_owner(self.shared.owner);
        let lock = self.lock.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let (Some(slot), Some(file)) = (self.lock_slot, lock.as_ref()) {
            crate::fork::forget_lock_fd(slot, file.as_raw_fd());
        }
        drop(lock);
    }

    /// A reader of the channel directory `dir` from global offset `pos`
    /// whose files close when this store does.
    pub fn reader(&self, dir: PathBuf, pos: u64) -> LogReader {
        LogReader::owned(dir, pos, self.shared.owner)
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        if self.process.is_foreign() {
            // The parent's fsync timer thread: not joined, not detached here.
            if let Some(t) = self
                .syncer
                .get_mut()
                .unwrap_or_else(|e| e.into_inner())
                .take()
            {
                std::mem::forget(t);
            }
            return;
        }
        self.close();
    }
}

impl Shared {
    fn run_syncer(&self) {
        let interval = Duration::from_millis(self.cfg.sync_interval_ms);
        let mut stop = self.stop.lock().unwrap_or_else(|e| e.into_inner());
        while !*stop {
            stop = self
                .stop_cv
                .wait_timeout(stop, interval)
                .unwrap_or_else(|e| e.into_inner())
                .0;
            drop(stop);
            let writers: Vec<_> = self
                .writers
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .values()
                .cloned()
                .collect();
            for w in writers {
                w.sync_if_dirty();
            }
            stop = self.stop.lock().unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// `data_dir/channels/<channel>` (the name must already be validated).
pub fn channel_dir(data_dir: &Path, channel: &str) -> PathBuf {
    data_dir.join(segment::CHANNELS_DIR).join(channel)
}
