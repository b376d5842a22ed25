//! Publishes that do not block: `publish(..., wait=False)` returns a
//! [`Receipt`]; asyncio awaits receipts through a [`Completer`], which
//! completes every future of one commit with one wake-up of the loop.
//! The blocking `publish` of Python's main thread also goes through a
//! receipt, waiting in slices so Ctrl-C is honoured while a commit is slow.

use std::cell::{Cell, RefCell};
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use keyop_core::storage::AfterBatch;
use keyop_core::{Error, Published, Submitted};
use pyo3::intern;
use pyo3::prelude::*;

use crate::errors::IntoPyResult;

/// How long a main-thread wait sleeps between checks for signals.
const SIGNAL_SLICE: Duration = Duration::from_millis(50);

thread_local! {
    /// Whether this thread is Python's main thread (where signal handlers
    /// run), once asked.
    static MAIN: Cell<Option<bool>> = const { Cell::new(None) };
}

/// Whether the calling thread is Python's main thread.
pub fn on_main_thread(py: Python<'_>) -> PyResult<bool> {
    if let Some(known) = MAIN.with(Cell::get) {
        return Ok(known);
    }
    let threading = py.import(intern!(py, "threading"))?;
    let main = threading.call_method0(intern!(py, "main_thread"))?;
    let current = threading.call_method0(intern!(py, "current_thread"))?;
    let is_main = main.is(&current);
    MAIN.with(|c| c.set(Some(is_main)));
    Ok(is_main)
}

/// Waits for `sub` with the GIL released, checking for signals every
/// [`SIGNAL_SLICE`]; `limit` None waits for as long as it takes. A signal's
/// exception (KeyboardInterrupt) is raised instead: the message may still be
/// committed, but it was not acknowledged. `Ok(None)`: the limit ran out.
pub fn wait_interruptibly(
    py: Python<'_>,
    sub: &Submitted,
    limit: Option<Duration>,
) -> PyResult<Option<Published>> {
    wait_slices(py, limit, |slice| sub.wait_timeout(slice))
}

/// [`wait_interruptibly`] for any outcome `wait(slice)` gives within a slice.
pub fn wait_slices<T>(
    py: Python<'_>,
    limit: Option<Duration>,
    mut wait: impl FnMut(Duration) -> Option<Result<T, Error>> + Send,
) -> PyResult<Option<T>>
where
    T: Send,
{
    let started = Instant::now();
    loop {
        let slice = limit.map_or(SIGNAL_SLICE, |l| {
            l.saturating_sub(started.elapsed()).min(SIGNAL_SLICE)
        });
        if let Some(r) = py.detach(|| wait(slice)) {
            return r.py_err(py).map(Some);
        }
        py.check_signals()?;
        if limit.is_some_and(|l| started.elapsed() >= l) {
            return Ok(None);
        }
    }
}

/// A message handed to the engine by `publish(..., wait=False)`: its id now,
/// its commit later. Call :meth:`wait` (or check :meth:`done`) to learn
/// whether it was committed; dropping a receipt does not cancel the publish.
#[pyclass(module = "keyop_messenger._core", name = "Receipt", frozen)]
pub struct Receipt {
    pub sub: Arc<Submitted>,
}

#[pymethods]
impl Receipt {
    /// The message id (a UUIDv7), known before the commit.
    #[getter]
    fn id(&self) -> &str {
        &self.sub.id
    }

    /// Whether the outcome (committed or failed) is known.
    fn done(&self) -> bool {
        self.sub.is_done()
    }

    /// Waits until the message is committed and returns its id; raises what
    /// a blocking ``publish`` would have raised (``StorageError``, ...), or
    /// ``KeyopTimeoutError`` if ``timeout`` seconds pass first (the message
    /// may still be committed later). Ctrl-C interrupts the wait.
    #[pyo3(signature = (timeout = None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<String> {
        let limit = match timeout {
            None => None,
            Some(t) => Some(crate::timeout_or(Some(t), Duration::ZERO)?),
        };
        match wait_interruptibly(py, &self.sub, limit)? {
            Some(p) => Ok(p.id),
            None => Err(Error::Timeout(format!(
                "message {} not committed within {:.3}s (it may still be)",
                self.sub.id,
                limit.unwrap_or_default().as_secs_f64()
            )))
            .py_err(py),
        }
    }

    fn __repr__(&self) -> String {
        let state = if self.sub.is_done() {
            "done"
        } else {
            "pending"
        };
        format!("<Receipt {} {state}>", self.sub.id)
    }
}

/// A future and the outcome it is to be completed with.
type Outcome = (Py<PyAny>, Result<String, Error>);

/// Outcomes waiting for the event loop, and whether the loop was woken for
/// them (it has yet to drain).
type Queue = Mutex<(Vec<Outcome>, bool)>;

thread_local! {
    /// Outcomes of the batch this (committing) thread is finishing, each
    /// with its completer's queue ([`queue_key`]). A batch's callbacks and
    /// then its after-callbacks run on one thread, one after another: the
    /// after-callback moves its completer's outcomes into the queue at once,
    /// so the loop never drains part of a batch (whose tasks would then
    /// publish in two passes and split the next batch). Dropping a future
    /// here (no GIL) defers its decref.
    static STAGED: RefCell<Vec<(usize, Outcome)>> = const { RefCell::new(Vec::new()) };
}

/// Which completer's queue a staged outcome belongs to (its address).
fn queue_key(queue: &Arc<Queue>) -> usize {
    Arc::as_ptr(queue) as usize
}

/// Completes asyncio futures of receipts on their event loop. The thread that
/// commits a batch never takes the GIL for it: it queues the outcomes and
/// writes one byte to a socket the loop watches (``loop.add_reader``), so
/// every outcome of one commit is handed over with one wake-up, and a busy
/// loop never holds up the next commit.
///
/// Its own `publish` holds each message's commit back until the loop has run
/// the tasks that were ready with it (a `call_soon` callback, queued behind
/// them): the tasks one commit wakes publish again in one pass of the loop,
/// and their messages then share one batch instead of the first going to
/// the disk alone and the rest waiting for the next fdatasync.
#[pyclass(module = "keyop_messenger._core", name = "Completer", frozen)]
pub struct Completer {
    event_loop: Py<PyAny>,
    queue: Arc<Queue>,
    /// The loop reads this end (registered with `add_reader`).
    wake_rx: UnixStream,
    /// Run by a committing thread once a batch's outcomes are queued: wakes
    /// the loop (a byte on the socket) unless it is already due to drain.
    wake: AfterBatch,
    /// Messages of this pass of the loop whose commit is held back; a
    /// `_release` callback is queued while this is not empty.
    held: Mutex<Vec<Submitted>>,
}

impl Completer {
    /// A future of this completer's loop that completes with `sub`'s outcome.
    fn future_of(&self, py: Python<'_>, sub: &Submitted) -> PyResult<Py<PyAny>> {
        let future = self
            .event_loop
            .bind(py)
            .call_method0(intern!(py, "create_future"))?
            .unbind();
        let fut = future.clone_ref(py);
        let key = queue_key(&self.queue);
        sub.on_done_then(
            move |r| STAGED.with(|s| s.borrow_mut().push((key, (fut, r.map(|p| p.id))))),
            &self.wake,
        );
        Ok(future)
    }

    /// Starts the commits held back so far: one release per channel, as a
    /// release starts every held message of its channel. The last message
    /// of each is the one released: a channel commits in order, so if that
    /// one is done, so are the others.
    fn release_held(&self) {
        let held = std::mem::take(&mut *self.held.lock().unwrap_or_else(|e| e.into_inner()));
        let mut released: Vec<&str> = Vec::new();
        for sub in held.iter().rev() {
            if !released.contains(&sub.channel()) {
                sub.release();
                released.push(sub.channel());
            }
        }
    }
}

#[pymethods]
impl Completer {
    /// Registers with `event_loop` (call from the loop's thread).
    #[new]
    fn new(py: Python<'_>, event_loop: Py<PyAny>) -> PyResult<Py<Self>> {
        let (wake_rx, wake_tx) = UnixStream::pair()?;
        wake_rx.set_nonblocking(true)?;
        wake_tx.set_nonblocking(true)?;
        let fd = wake_rx.as_raw_fd();
        let queue = Arc::<Queue>::default();
        let woken = queue.clone();
        let wake: AfterBatch = Arc::new(move || {
            let key = queue_key(&woken);
            let mine: Vec<Outcome> = STAGED.with(|s| {
                let mut staged = s.borrow_mut();
                let (mine, rest): (Vec<_>, Vec<_>) = staged.drain(..).partition(|o| o.0 == key);
                staged.extend(rest);
                mine.into_iter().map(|(_, outcome)| outcome).collect()
            });
            let due = {
                let mut q = woken.lock().unwrap_or_else(|e| e.into_inner());
                q.0.extend(mine);
                !q.0.is_empty() && !std::mem::replace(&mut q.1, true)
            };
            // One byte per wake-up; a full socket means the loop is already
            // due to drain.
            if due {
                let _ = (&wake_tx).write(&[1]);
            }
        });
        let this = Py::new(
            py,
            Completer {
                event_loop,
                queue,
                wake_rx,
                wake,
                held: Mutex::default(),
            },
        )?;
        let drain = this.bind(py).getattr(intern!(py, "_drain"))?;
        this.get()
            .event_loop
            .bind(py)
            .call_method1(intern!(py, "add_reader"), (fd, drain))?;
        Ok(this)
    }

    /// `messenger.publish(...)` for a task of this completer's loop: a
    /// future that completes with the message id once committed, or with
    /// the error `publish` would have raised. The message is handed to the
    /// engine now; its commit starts once the loop has run the tasks ready
    /// before this callback (see the type's notes). Call from the loop's
    /// thread.
    #[pyo3(signature = (messenger, channel, payload_type, payload, service_name = None, correlation_id = None))]
    #[allow(clippy::too_many_arguments)]
    fn publish<'py>(
        slf: &Bound<'py, Self>,
        messenger: &Bound<'py, crate::MessengerBase>,
        channel: &Bound<'py, PyAny>,
        payload_type: &Bound<'py, PyAny>,
        payload: &Bound<'py, PyAny>,
        service_name: Option<&Bound<'py, PyAny>>,
        correlation_id: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Py<PyAny>> {
        let py = slf.py();
        let args = crate::PublishArgs {
            channel,
            payload_type,
            payload,
            service_name,
            correlation_id,
        };
        let sent = messenger
            .get()
            .publish_as(py, args, crate::Handover::Held)?;
        let crate::Sent::Submitted(sub) = sent else {
            unreachable!("a held hand-over gives the submitted message")
        };
        let this = slf.get();
        let future = this.future_of(py, &sub);
        let first = {
            let mut held = this.held.lock().unwrap_or_else(|e| e.into_inner());
            held.push(sub);
            held.len() == 1
        };
        if first {
            let scheduled = slf.getattr(intern!(py, "_release")).and_then(|release| {
                this.event_loop
                    .bind(py)
                    .call_method1(intern!(py, "call_soon"), (release,))
            });
            if let Err(e) = scheduled {
                // A closed loop: commit now rather than hold.
                this.release_held();
                return Err(e);
            }
        }
        future
    }

    /// Runs on the loop (queued by `publish`): starts the held commits.
    fn _release(&self) {
        self.release_held();
    }

    /// Runs on the loop when woken: completes every future whose outcome
    /// arrived.
    fn _drain(&self, py: Python<'_>) -> PyResult<()> {
        let mut sink = [0u8; 64];
        while matches!((&self.wake_rx).read(&mut sink), Ok(n) if n > 0) {}
        let ready = {
            let mut q = self.queue.lock().unwrap_or_else(|e| e.into_inner());
            q.1 = false;
            std::mem::take(&mut q.0)
        };
        // Every future is completed even if one refuses; the first such
        // error is raised after.
        let mut failed = None;
        for (future, outcome) in ready {
            let future = future.bind(py);
            let set = match outcome.py_err(py) {
                Ok(id) => future.call_method1(intern!(py, "set_result"), (id,)),
                Err(e) => future.call_method1(intern!(py, "set_exception"), (e.value(py),)),
            };
            // Refused only by a future already done: cancelled by its awaiter.
            if let Err(e) = set {
                let done = future
                    .call_method0(intern!(py, "done"))
                    .and_then(|d| d.is_truthy());
                if !matches!(done, Ok(true)) {
                    failed.get_or_insert(e);
                }
            }
        }
        failed.map_or(Ok(()), Err)
    }

    /// Completes the futures whose outcomes arrived, then stops watching
    /// (removes the loop's reader); outcomes arriving later are dropped with
    /// their futures. Idempotent; a closed loop is fine.
    fn close(&self, py: Python<'_>) {
        self.release_held();
        if let Err(e) = self._drain(py) {
            log::warn!("completing publish futures at close: {e}");
        }
        let fd = self.wake_rx.as_raw_fd();
        let _ = self
            .event_loop
            .bind(py)
            .call_method1(intern!(py, "remove_reader"), (fd,));
    }
}
