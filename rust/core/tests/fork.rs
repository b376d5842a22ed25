//! Fork safety of the engine: an engine opened before `fork()` refuses every
//! call in the child and releases nothing there; the child does not keep the
//! parent's lock; ids stay unique across the fork.
//!
//! Everything runs inside a single test of its own binary: a forked child has
//! only the forking thread, so no other test thread may be running (holding
//! a lock) at the moment of the fork.

use std::io::{Read as _, Write as _};
use std::os::unix::io::FromRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use keyop_core::envelope::Stamp;
use keyop_core::storage::StorageError;
use keyop_core::{BatchOutcome, Delivery, Error, Handler, SubscribeOptions};

mod common;
use common::{ids_on_disk, msg, open_engine};

/// Forks; the child runs `f`, writes its output to a pipe and `_exit`s
/// (0 on success, 1 when `f` panicked). Returns (exit code, output).
fn in_child(f: impl FnOnce() -> String) -> (i32, String) {
    let mut fds = [0; 2];
    // SAFETY: plain pipe and fork; the child only runs `f` and _exit.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        unsafe { libc::close(fds[0]) };
        let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
        let code = i32::from(out.is_err());
        let mut w = unsafe { std::fs::File::from_raw_fd(fds[1]) };
        let _ = w.write_all(out.unwrap_or_default().as_bytes());
        drop(w);
        unsafe { libc::_exit(code) };
    }
    unsafe { libc::close(fds[1]) };
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut status = 0;
    loop {
        let done = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if done == pid {
            break;
        }
        if Instant::now() > deadline {
            unsafe { libc::kill(pid, libc::SIGKILL) };
            unsafe { libc::waitpid(pid, &mut status, 0) };
            panic!("the forked child hung");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let mut out = String::new();
    let mut r = unsafe { std::fs::File::from_raw_fd(fds[0]) };
    r.read_to_string(&mut out).expect("read pipe");
    assert!(libc::WIFEXITED(status), "child died: {status}");
    (libc::WEXITSTATUS(status), out)
}

/// A handler that records its first call, then blocks until released.
#[derive(Clone, Default)]
struct Stuck {
    entered: Arc<AtomicBool>,
    release: Arc<AtomicBool>,
    calls: Arc<Mutex<Vec<String>>>,
}

impl Handler for Stuck {
    fn handle(&mut self, batch: &[Delivery]) -> BatchOutcome {
        self.calls
            .lock()
            .unwrap()
            .push(batch[0].envelope().id.into_owned());
        self.entered.store(true, Ordering::SeqCst);
        while !self.release.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(5));
        }
        BatchOutcome {
            handled: batch.len(),
            failure: None,
        }
    }
}

#[test]
fn fork_scenarios() {
    inherited_engine_refuses_and_releases_nothing();
    child_does_not_keep_the_lock();
    ids_are_unique_across_a_fork();
}

fn inherited_engine_refuses_and_releases_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let engine = open_engine(dir.path(), 0).unwrap();
    let stuck = Stuck::default();
    stuck.release.store(true, Ordering::SeqCst);
    let _sub = engine
        .subscribe("c", "s", stuck, SubscribeOptions::default())
        .unwrap();
    let first = engine.publish("c", &msg("{}")).unwrap().id;
    let parent = std::process::id();
    let (code, out) = in_child(move || {
        let e = engine.publish("c", &msg("{\"child\":1}")).unwrap_err();
        assert!(matches!(e, Error::Forked(_)), "{e}");
        assert!(engine.read("c", 0).is_err());
        assert!(matches!(engine.channel_stats(), Err(Error::Forked(_))));
        engine.close();
        drop(engine); // neither joins the parent's threads nor touches files
        e.to_string()
    });
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains(&format!("opened in process {parent}")),
        "{out}"
    );
    assert!(out.contains("open a new one in the child"), "{out}");
    // (The engine moved into the closure is the parent's too: reopen.)
    let engine = open_engine(dir.path(), 0).unwrap();
    let second = engine.publish("c", &msg("{}")).unwrap().id;
    drop(engine);
    assert_eq!(ids_on_disk(dir.path(), "c"), vec![first, second]);
}

fn child_does_not_keep_the_lock() {
    let dir = tempfile::tempdir().unwrap();
    let engine = open_engine(dir.path(), 0).unwrap();
    let mut go = [0; 2];
    assert_eq!(unsafe { libc::pipe(go.as_mut_ptr()) }, 0);
    let (rd, wr) = (go[0], go[1]);
    let path = dir.path().to_owned();
    // The child tries the held lock, then waits until the parent closed and
    // reopened.
    let child = unsafe { libc::fork() };
    if child == 0 {
        unsafe { libc::close(wr) };
        let locked = matches!(
            open_engine(&path, 0),
            Err(Error::Storage(StorageError::Locked(_)))
        );
        let mut b = [0u8; 1];
        unsafe { libc::read(rd, b.as_mut_ptr().cast(), 1) };
        unsafe { libc::_exit(if locked { 0 } else { 3 }) };
    }
    unsafe { libc::close(rd) };
    // Give the child time to try the lock while the parent holds it.
    std::thread::sleep(Duration::from_millis(200));
    engine.close();
    let reopened = open_engine(dir.path(), 0);
    unsafe { libc::write(wr, b"x".as_ptr().cast(), 1) };
    unsafe { libc::close(wr) };
    let mut status = 0;
    unsafe { libc::waitpid(child, &mut status, 0) };
    assert!(
        reopened.is_ok(),
        "the child kept the lock: {:?}",
        reopened.err()
    );
    assert_eq!(
        libc::WEXITSTATUS(status),
        0,
        "the child could take the held lock"
    );
}

fn ids_are_unique_across_a_fork() {
    let _warm = Stamp::now();
    let (code, out) = in_child(|| {
        (0..100)
            .map(|_| Stamp::now().id().to_owned())
            .collect::<Vec<_>>()
            .join(",")
    });
    let mine: Vec<String> = (0..100).map(|_| Stamp::now().id().to_owned()).collect();
    assert_eq!(code, 0);
    let theirs: Vec<&str> = out.split(',').collect();
    assert_eq!(theirs.len(), 100);
    // Everything after the version digit comes from the generator.
    let tails: std::collections::HashSet<&str> = mine.iter().map(|i| &i[15..]).collect();
    for t in &theirs {
        assert!(
            !tails.contains(&t[15..]),
            "id {t} repeats the parent's random bits"
        );
    }
}
