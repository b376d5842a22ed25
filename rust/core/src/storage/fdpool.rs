//! A bounded pool of open segment files, shared by every writer and reader
//! of the process (descriptors are a per-process resource).
//!
//! A writer's active segment and a reader's current segment are held as a
//! [`PooledFile`]: a path plus the identity (device, inode) of the file it
//! named when first opened. The pool keeps at most [`FilePool::capacity`]
//! of them open, closing the least recently used; [`PooledFile::get`]
//! reopens an evicted one on demand and refuses a file that is no longer
//! the one it opened (unlinked, or replaced by another file). So the number
//! of channels is bounded by the disk, not by `RLIMIT_NOFILE`.
//!
//! The capacity is a quarter of the soft descriptor limit (between 8 and
//! 8192), leaving the rest for sockets, the lock and audit files, and the
//! host program. A file in use (an `Arc` handed out by `get`) stays open
//! until its user lets go of it even if evicted meanwhile, so the count can
//! briefly exceed the capacity by the number of reads and commits running.
//!
//! Files belong to an owner (a [`super::Store`]): closing the owner closes
//! every file of it at once and refuses to reopen them.

use std::collections::HashSet;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use lru::LruCache;

/// Owner id of files no store owns (standalone readers); never closed.
pub const NO_OWNER: u64 = 0;

struct Entry {
    file: Arc<File>,
    owner: u64,
}

struct Inner {
    open: LruCache<u64, Entry>,
    capacity: usize,
    closed_owners: HashSet<u64>,
}

/// The process-wide pool (see the module documentation).
pub struct FilePool {
    inner: Mutex<Inner>,
    next_id: AtomicU64,
}

/// The process-wide pool.
pub fn pool() -> &'static FilePool {
    static POOL: OnceLock<FilePool> = OnceLock::new();
    POOL.get_or_init(|| {
        // SAFETY: registers plain functions; they only lock and unlock the
        // pool's mutex on the forking thread.
        unsafe {
            libc::pthread_atfork(Some(fork_prepare), Some(fork_done), Some(fork_done));
        }
        FilePool {
            inner: Mutex::new(Inner {
                open: LruCache::unbounded(),
                capacity: capacity_from_rlimit(),
                closed_owners: HashSet::new(),
            }),
            next_id: AtomicU64::new(1),
        }
    })
}

thread_local! {
    /// The pool's lock, held by the forking thread across `fork()`.
    static FORK_GUARD: std::cell::RefCell<Option<MutexGuard<'static, Inner>>> =
        const { std::cell::RefCell::new(None) };
}

/// Before `fork()`: takes the pool's lock, so no other thread holds it at
/// the moment the child is made (a child would otherwise inherit it locked
/// and hang at its first segment file, e.g. a forked Spark worker).
extern "C" fn fork_prepare() {
    let guard = pool().lock();
    FORK_GUARD.with(|g| *g.borrow_mut() = Some(guard));
}

/// After `fork()`, in the parent and in the child: releases it.
extern "C" fn fork_done() {
    FORK_GUARD.with(|g| g.borrow_mut().take());
}

/// A quarter of the soft `RLIMIT_NOFILE`, between 8 and 8192.
pub fn capacity_from_rlimit() -> usize {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct we pass.
    let soft = if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0 {
        lim.rlim_cur
    } else {
        1024
    };
    usize::try_from(soft / 4).unwrap_or(8192).clamp(8, 8192)
}

impl FilePool {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Most files kept open at once.
    pub fn capacity(&self) -> usize {
        self.lock().capacity
    }

    /// Sets the capacity again from the current descriptor limit (called
    /// when a store opens, so a limit lowered since is honoured).
    pub fn refresh_capacity(&self) {
        let cap = capacity_from_rlimit();
        let mut inner = self.lock();
        inner.capacity = cap;
        while inner.open.len() > cap {
            inner.open.pop_lru();
        }
    }

    /// Files open in the pool now.
    pub fn open_count(&self) -> usize {
        self.lock().open.len()
    }

    /// A new owner id (one per store).
    pub fn new_owner(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Closes every file of `owner` now and refuses to reopen them.
    pub fn close_owner(&self, owner: u64) {
        let mut dropped = Vec::new();
        {
            let mut inner = self.lock();
            inner.closed_owners.insert(owner);
            let ids: Vec<u64> = inner
                .open
                .iter()
                .filter(|(_, e)| e.owner == owner)
                .map(|(&id, _)| id)
                .collect();
            for id in ids {
                dropped.extend(inner.open.pop(&id));
            }
        }
        drop(dropped); // closed outside the lock
    }

    fn insert(&self, id: u64, owner: u64, file: Arc<File>) -> io::Result<()> {
        let mut evicted = Vec::new();
        {
            let mut inner = self.lock();
            if inner.closed_owners.contains(&owner) {
                return Err(closed_error());
            }
            while inner.open.len() >= inner.capacity {
                match inner.open.pop_lru() {
                    Some(e) => evicted.push(e),
                    None => break,
                }
            }
            inner.open.put(id, Entry { file, owner });
        }
        drop(evicted);
        Ok(())
    }

    fn lookup(&self, id: u64) -> Option<Arc<File>> {
        self.lock().open.get(&id).map(|e| e.file.clone())
    }

    fn remove(&self, id: u64) {
        let removed = self.lock().open.pop(&id);
        drop(removed);
    }

    /// Closes the least recently used half of the pool (after EMFILE).
    fn shed(&self) {
        let mut evicted = Vec::new();
        {
            let mut inner = self.lock();
            let keep = inner.open.len() / 2;
            while inner.open.len() > keep {
                evicted.extend(inner.open.pop_lru());
            }
        }
        drop(evicted);
    }
}

fn closed_error() -> io::Error {
    io::Error::other("the messenger owning this file is closed")
}

/// The error of a file that is no longer the one its path named.
#[derive(Debug)]
struct FileChanged(String);

impl std::fmt::Display for FileChanged {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for FileChanged {}

fn unlinked(path: &Path) -> io::Error {
    io::Error::new(
        io::ErrorKind::NotFound,
        FileChanged(format!("{} was unlinked while open", path.display())),
    )
}

fn replaced(path: &Path) -> io::Error {
    io::Error::other(FileChanged(format!(
        "{} was replaced by another file while open",
        path.display()
    )))
}

/// Whether `e` says a file was unlinked or replaced while open.
pub fn is_file_changed(e: &io::Error) -> bool {
    e.get_ref().is_some_and(|r| r.is::<FileChanged>())
}

/// Device and inode of an open file.
pub fn identity(file: &File) -> io::Result<(u64, u64)> {
    let m = file.metadata()?;
    Ok((m.dev(), m.ino()))
}

/// Whether `file` (opened as `path`, identity `ident`) is still the file
/// named `path`. The error says what happened: unlinked or replaced.
pub fn check_identity(file: &File, path: &Path, ident: (u64, u64)) -> io::Result<()> {
    let linked = file.metadata()?.nlink() > 0;
    match std::fs::metadata(path) {
        Ok(m) if linked && (m.dev(), m.ino()) == ident => Ok(()),
        Ok(_) => Err(replaced(path)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Err(unlinked(path)),
        Err(e) => Err(e),
    }
}

/// One file held through the pool; closes it when dropped.
pub struct PooledFile {
    id: u64,
    owner: u64,
    path: PathBuf,
    write: bool,
    ident: (u64, u64),
}

fn open_raw(path: &Path, write: bool) -> io::Result<File> {
    let open = || OpenOptions::new().read(true).write(write).open(path);
    match open() {
        Err(e) if e.raw_os_error() == Some(libc::EMFILE) => {
            pool().shed();
            open()
        }
        r => r,
    }
}

impl PooledFile {
    /// Opens `path` (read-only, or read-write) into the pool.
    pub fn open(path: &Path, write: bool, owner: u64) -> io::Result<PooledFile> {
        Self::adopt(path, open_raw(path, write)?, write, owner)
    }

    /// Puts an already open `file` (named `path`) into the pool.
    pub fn adopt(path: &Path, file: File, write: bool, owner: u64) -> io::Result<PooledFile> {
        let p = pool();
        let pf = PooledFile {
            id: p.next_id.fetch_add(1, Ordering::Relaxed),
            owner,
            path: path.to_owned(),
            write,
            ident: identity(&file)?,
        };
        p.insert(pf.id, owner, Arc::new(file))?;
        Ok(pf)
    }

    /// The path the file was opened as.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Device and inode of the file when it was opened.
    pub fn ident(&self) -> (u64, u64) {
        self.ident
    }

    /// The open file, reopened if it was evicted. Fails if the path no
    /// longer names the same file (NotFound when it is gone).
    pub fn get(&self) -> io::Result<Arc<File>> {
        let p = pool();
        if let Some(f) = p.lookup(self.id) {
            return Ok(f);
        }
        let file = match open_raw(&self.path, self.write) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(unlinked(&self.path)),
            Err(e) => return Err(e),
        };
        if identity(&file)? != self.ident {
            return Err(replaced(&self.path));
        }
        let file = Arc::new(file);
        p.insert(self.id, self.owner, file.clone())?;
        Ok(file)
    }
}

impl Drop for PooledFile {
    fn drop(&mut self) {
        pool().remove(self.id);
    }
}

impl std::fmt::Debug for PooledFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PooledFile")
            .field("path", &self.path)
            .finish()
    }
}
