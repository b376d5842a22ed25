//! Publishes that do not block: `publish(..., wait=False)` returns a
//! [`Receipt`]; asyncio awaits receipts through a [`Completer`], which
//! completes every future of one commit with one wake-up of the loop.
//! The blocking `publish` of Python's main thread also goes through a
//! receipt, waiting in slices so Ctrl-C is honoured while a commit is slow.

use std::cell::Cell;
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

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

/// Outcomes waiting for the event loop, and whether the loop was woken for
/// them.
type Queue = Mutex<(Vec<(Py<PyAny>, Result<String, Error>)>, bool)>;

/// Completes asyncio futures of receipts on their event loop. The thread that
/// commits a batch never takes the GIL for it: it queues the outcomes and
/// writes one byte to a socket the loop watches (``loop.add_reader``), so
/// every outcome of one commit is handed over with one wake-up, and a busy
/// loop never holds up the next commit.
#[pyclass(module = "keyop_messenger._core", name = "Completer", frozen)]
pub struct Completer {
    event_loop: Py<PyAny>,
    queue: Arc<Queue>,
    /// The loop reads this end (registered with `add_reader`).
    wake_rx: UnixStream,
    /// Committing threads write a byte here.
    wake_tx: Arc<UnixStream>,
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
        let this = Py::new(
            py,
            Completer {
                event_loop,
                queue: Arc::default(),
                wake_rx,
                wake_tx: Arc::new(wake_tx),
            },
        )?;
        let drain = this.bind(py).getattr(intern!(py, "_drain"))?;
        this.get()
            .event_loop
            .bind(py)
            .call_method1(intern!(py, "add_reader"), (fd, drain))?;
        Ok(this)
    }

    /// A future of this completer's loop that completes with the receipt's
    /// message id, or with its error. Call from the loop's thread.
    fn watch(&self, py: Python<'_>, receipt: &Receipt) -> PyResult<Py<PyAny>> {
        let future = self
            .event_loop
            .bind(py)
            .call_method0(intern!(py, "create_future"))?
            .unbind();
        let fut = future.clone_ref(py);
        let queue = self.queue.clone();
        let wake = self.wake_tx.clone();
        receipt.sub.on_done(move |r| {
            let first = {
                let mut q = queue.lock().unwrap_or_else(|e| e.into_inner());
                q.0.push((fut, r.map(|p| p.id)));
                !std::mem::replace(&mut q.1, true)
            };
            // One byte per wake-up; a full socket means the loop is already
            // due to drain. Dropping `fut` here (no GIL) defers its decref.
            if first {
                let _ = (&*wake).write(&[1]);
            }
        });
        Ok(future)
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
        for (future, outcome) in ready {
            let future = future.bind(py);
            if future.call_method0(intern!(py, "done"))?.is_truthy()? {
                continue; // cancelled by its awaiter
            }
            match outcome.py_err(py) {
                Ok(id) => future.call_method1(intern!(py, "set_result"), (id,))?,
                Err(e) => future.call_method1(intern!(py, "set_exception"), (e.value(py),))?,
            };
        }
        Ok(())
    }

    /// Completes the futures whose outcomes arrived, then stops watching
    /// (removes the loop's reader); outcomes arriving later are dropped with
    /// their futures. Idempotent; a closed loop is fine.
    fn close(&self, py: Python<'_>) {
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
