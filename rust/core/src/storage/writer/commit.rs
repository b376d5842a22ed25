//! The I/O of a batch: positioned writes, fdatasync, segment rolls, cutting
//! back a failed write, and the check that the active segment is still the
//! file its path names (after the write, before any caller is acknowledged:
//! every batch in durable mode, at most once a millisecond in relaxed mode).
//! An unlinked segment is written back from the open file; a replaced one
//! stops the writer until the data directory is opened again.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{io_err, Active, ChannelWriter, FaultPoint};
use crate::storage::fdpool::{self, PooledFile};
use crate::storage::{segment, StorageError};

impl ChannelWriter {
    fn ctx(&self, what: &str, active: &Active) -> String {
        format!(
            "channel {:?}: {what} ({}); not committed",
            self.channel,
            active.file.path().display()
        )
    }

    /// The active segment changed under the writer (unlinked or replaced):
    /// the error every later append of this writer returns.
    fn lost_segment(&self, active: &mut Active, e: io::Error) -> StorageError {
        let err = io_err(
            format!(
                "channel {:?}: the active segment is no longer in the data directory; \
                 not committed, and the channel refuses appends until the messenger is \
                 opened again",
                self.channel
            ),
            e,
        );
        log::error!("{err}");
        active.broken = Some(err.clone());
        err
    }

    /// The active file, reopened if the descriptor pool closed it; an
    /// unlinked or replaced file breaks the writer.
    fn active_file(&self, active: &mut Active) -> Result<Arc<File>, StorageError> {
        match active.file.get() {
            Ok(f) => Ok(f),
            Err(e) if is_lost(&e) => Err(self.lost_segment(active, e)),
            Err(e) => Err(io_err(
                self.ctx("cannot open the active segment", active),
                e,
            )),
        }
    }

    /// Writes the batch, rolling segments between append groups. Returns how
    /// many leading bytes were committed and the error that stopped the rest.
    pub(super) fn flush(
        &self,
        active: &mut Active,
        buf: &[u8],
        groups: &[(usize, u64)],
    ) -> (usize, Option<StorageError>) {
        if let Some(e) = &active.broken {
            return (0, Some(e.clone()));
        }
        if active.tainted {
            if let Err(e) = self.truncate(active) {
                return (
                    0,
                    Some(io_err(
                        self.ctx("cannot cut back a failed write", active),
                        e,
                    )),
                );
            }
        }
        let limit = self.cfg.segment_bytes;
        let mut run_start = 0;
        let mut pos = 0;
        for &(len, _) in groups {
            let run = (pos - run_start) as u64;
            if limit > 0 && active.len + run > 0 && active.len + run + len as u64 > limit {
                if let Err(e) = self.commit_run(active, &buf[run_start..pos], self.cfg.durable) {
                    return (run_start, Some(e));
                }
                // The run (if any) is committed in the segment being sealed.
                if let Err(e) = self.roll(active) {
                    return (pos, Some(e));
                }
                run_start = pos;
            }
            pos += len;
        }
        match self.commit_run(active, &buf[run_start..pos], self.cfg.durable) {
            Ok(()) => (pos, None),
            Err(e) => (run_start, Some(e)),
        }
    }

    /// Writes `data` at the end of the active segment and optionally
    /// fdatasyncs, then checks the file is still the one its path names; on
    /// failure the segment is cut back to where it was.
    pub(super) fn commit_run(
        &self,
        active: &mut Active,
        data: &[u8],
        sync: bool,
    ) -> Result<(), StorageError> {
        if data.is_empty() {
            return Ok(());
        }
        let file = self.active_file(active)?;
        let res = match self
            .take_fault(|p| matches!(p, FaultPoint::Write { .. } | FaultPoint::WriteErrno { .. }))
        {
            Some(FaultPoint::Write { partial }) => fail_after(
                &file,
                &data[..partial.min(data.len())],
                active.len,
                libc::ENOSPC,
            ),
            Some(FaultPoint::WriteErrno { partial, errno }) => {
                fail_after(&file, &data[..partial.min(data.len())], active.len, errno)
            }
            _ => file.write_all_at(data, active.len),
        };
        if let Err(e) = res {
            active.tainted = true;
            let _ = self.truncate(active);
            return Err(io_err(self.ctx("write failed", active), e));
        }
        self.counters.writes.fetch_add(1, Ordering::Relaxed);
        if !sync && data.len() >= WRITEBACK_FROM {
            start_writeback(&file, active.len, data.len());
        }
        if sync {
            if let Err(e) = self.sync(&file) {
                active.tainted = true;
                let _ = self.truncate(active);
                return Err(io_err(self.ctx("fdatasync failed", active), e));
            }
        }
        // Before anyone is acknowledged: bytes written into a file that was
        // unlinked or replaced are in no one's data directory. Once per batch
        // in durable mode (next to an fdatasync it costs nothing); at most
        // once per RELAXED_CHECK_EVERY in relaxed mode, where a batch is a
        // plain write and acknowledgements are not durable anyway (an
        // unlinked file is written back whole from the open descriptor).
        let now = coarse_now();
        let due = sync || now.saturating_sub(active.checked) >= RELAXED_CHECK_EVERY;
        let checked = if due {
            active.checked = now;
            fdpool::check_identity(&file, active.file.path(), active.file.ident())
        } else {
            Ok(())
        };
        if let Err(e) = checked {
            return Err(if is_lost(&e) && e.kind() == io::ErrorKind::NotFound {
                // Unlinked: what was committed is still in the open file.
                match self.restore(active, &file) {
                    Ok(()) => {
                        let err = io_err(
                            format!(
                                "channel {:?}: the active segment was unlinked while open; its {} \
                                 committed bytes were written back from the open file; \
                                 not committed, publish again",
                                self.channel, active.len
                            ),
                            e,
                        );
                        log::error!("{err}");
                        err
                    }
                    Err(re) => {
                        log::error!(
                            "channel {:?}: cannot write back the unlinked segment {}: {re}",
                            self.channel,
                            active.file.path().display()
                        );
                        self.lost_segment(active, e)
                    }
                }
            } else if is_lost(&e) {
                self.lost_segment(active, e)
            } else {
                active.tainted = true;
                let _ = self.truncate(active);
                io_err(self.ctx("cannot check the active segment", active), e)
            });
        }
        active.len += data.len() as u64;
        if sync {
            self.durable_end
                .fetch_max(active.start + active.len, Ordering::AcqRel);
        }
        Ok(())
    }

    /// Writes the committed bytes of the unlinked active segment, still
    /// readable through `orphan`, to a new file at its path and makes that
    /// the active segment.
    fn restore(&self, active: &mut Active, orphan: &File) -> io::Result<()> {
        use std::os::unix::fs::OpenOptionsExt;
        let path = active.file.path().to_owned();
        // Readers still holding the old file reach its end at the committed
        // length, then open the path again (same offsets, new file).
        orphan.set_len(active.len)?;
        let new = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o644)
            .open(&path)?;
        let copied = (|| {
            let mut buf = vec![0u8; 1 << 20];
            let mut at = 0;
            while at < active.len {
                let n = (active.len - at).min(buf.len() as u64) as usize;
                orphan.read_exact_at(&mut buf[..n], at)?;
                new.write_all_at(&buf[..n], at)?;
                at += n as u64;
            }
            new.sync_all()?;
            segment::sync_dir(&self.dir)
        })();
        if let Err(e) = copied {
            let _ = std::fs::remove_file(&path);
            return Err(e);
        }
        active.file = Arc::new(PooledFile::adopt(&path, new, true, self.owner)?);
        active.tainted = false;
        Ok(())
    }

    pub(super) fn sync(&self, file: &File) -> io::Result<()> {
        self.counters.fsyncs.fetch_add(1, Ordering::Relaxed);
        let fault = self.take_fault(|p| {
            matches!(
                p,
                FaultPoint::Sync | FaultPoint::SyncErrno { .. } | FaultPoint::SyncDelay { .. }
            )
        });
        match fault {
            Some(FaultPoint::SyncErrno { errno }) => {
                return Err(io::Error::from_raw_os_error(errno))
            }
            Some(FaultPoint::SyncDelay { ms }) => {
                std::thread::sleep(std::time::Duration::from_millis(ms))
            }
            Some(_) => return Err(io::Error::from_raw_os_error(libc::EIO)),
            None => {}
        }
        let started = Instant::now();
        let res = file.sync_data();
        let took = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.last_sync_ns.store(took, Ordering::Relaxed);
        res
    }

    /// Cuts the active segment back to its committed length.
    pub(super) fn truncate(&self, active: &mut Active) -> io::Result<()> {
        active.file.get()?.set_len(active.len)?;
        active.tainted = false;
        Ok(())
    }

    /// Seals the active segment (already synced by the caller's run) and
    /// starts the next one. On failure the old segment stays active.
    fn roll(&self, active: &mut Active) -> Result<(), StorageError> {
        if !self.cfg.durable {
            // Relaxed mode: the sealed segment is still synced before it is left.
            let file = self.active_file(active)?;
            self.sync(&file)
                .map_err(|e| io_err(self.ctx("fdatasync before segment roll failed", active), e))?;
        }
        let next = active.start + active.len;
        // Everything before `next` is synced now (each commit in durable mode,
        // the sync above in relaxed mode).
        self.durable_end.fetch_max(next, Ordering::AcqRel);
        let path = segment::segment_path(&self.dir, next);
        let created = if self.take_fault(|p| *p == FaultPoint::Roll).is_some() {
            Err(io::Error::from_raw_os_error(libc::ENOSPC))
        } else {
            segment::create_segment(&self.dir, next)
        };
        let file = created
            .and_then(|f| PooledFile::adopt(&path, f, true, self.owner))
            .map_err(|e| {
                io_err(
                    format!(
                        "channel {:?}: cannot create the next segment ({}); not committed",
                        self.channel,
                        path.display()
                    ),
                    e,
                )
            })?;
        *active = Active {
            file: Arc::new(file),
            start: next,
            len: 0,
            tainted: false,
            broken: None,
            checked: coarse_now(),
        };
        self.counters.rolls.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

/// Relaxed mode: the active segment is checked at most this often.
const RELAXED_CHECK_EVERY: Duration = Duration::from_millis(1);

/// Monotonic time, for pacing the relaxed-mode check: on Linux at the
/// kernel's tick (`CLOCK_MONOTONIC_COARSE`, a few milliseconds), which costs
/// a fifth of a precise reading and is read on every relaxed write.
#[cfg(target_os = "linux")]
pub(super) fn coarse_now() -> Duration {
    let mut ts = std::mem::MaybeUninit::<libc::timespec>::zeroed();
    // SAFETY: `ts` is a zeroed timespec (a valid value of it, whatever
    // padding the target's layout has) for the call to fill in; the call
    // cannot fail for this clock.
    let ts = unsafe {
        libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, ts.as_mut_ptr());
        ts.assume_init()
    };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

#[cfg(not(target_os = "linux"))]
pub(super) fn coarse_now() -> Duration {
    static ORIGIN: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    ORIGIN.get_or_init(Instant::now).elapsed()
}

/// Test hook: writes `part` for real, then fails with `errno`.
fn fail_after(file: &File, part: &[u8], at: u64, errno: i32) -> io::Result<()> {
    file.write_all_at(part, at)?;
    Err(io::Error::from_raw_os_error(errno))
}

fn is_lost(e: &io::Error) -> bool {
    fdpool::is_file_changed(e)
}

/// Relaxed mode: a run of at least this many bytes has its write-back to
/// disk started at once (see [`start_writeback`]).
const WRITEBACK_FROM: usize = 1 << 20;

/// Starts writing `len` bytes at `offset` of `file` back to disk without
/// waiting (Linux `sync_file_range(SYNC_FILE_RANGE_WRITE)`): the next
/// fdatasync then finds little left to write, instead of a large run's
/// worth. Advice only: durability still comes from that fdatasync, and a
/// failure here is ignored (the fdatasync reports the disk's errors).
#[cfg(target_os = "linux")]
fn start_writeback(file: &File, offset: u64, len: usize) {
    use std::os::fd::AsRawFd;
    let (Ok(offset), Ok(len)) = (
        libc::off64_t::try_from(offset),
        libc::off64_t::try_from(len),
    ) else {
        return;
    };
    // SAFETY: a plain system call on an open descriptor; no memory is passed.
    unsafe {
        libc::sync_file_range(file.as_raw_fd(), offset, len, libc::SYNC_FILE_RANGE_WRITE);
    }
}

#[cfg(not(target_os = "linux"))]
fn start_writeback(_file: &File, _offset: u64, _len: usize) {}
