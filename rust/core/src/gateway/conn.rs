//! Connections: accept, TLS (client certificate optional), HTTP/1.1 with a
//! header timeout, and an idle timeout over the bytes moved either way; a
//! flood of connections that never finish opening makes way for newcomers
//! ([`super::slots`]).

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;
use tokio_rustls::TlsAcceptor;

use super::activity::Activity;
use super::slots::{Evicted, Opening, Pending};
use super::State;
use crate::federation::tls;

/// TLS handshakes that failed are logged at most once per 10 s (all counted).
static TLS_FAILURES_LOGGED: crate::lograte::RateLimit =
    crate::lograte::RateLimit::new(Duration::from_secs(10));
/// Opening connections dropped to make room, logged at most once per 10 s.
static EVICTIONS_LOGGED: crate::lograte::RateLimit =
    crate::lograte::RateLimit::new(Duration::from_secs(10));

/// Accepts connections until cancelled, then ends every connection. When
/// all `gateway.max_connections` slots are taken, the oldest connection that
/// has not yet sent its first request is dropped for the newcomer (none:
/// the newcomer waits for a slot, as the backlog does).
pub(super) async fn accept_loop(
    state: Arc<State>,
    listener: TcpListener,
    tls: Arc<rustls::ServerConfig>,
) {
    let acceptor = TlsAcceptor::from(tls);
    let max = state.cfg.max_connections.max(1);
    let slots = Arc::new(tokio::sync::Semaphore::new(max));
    let opening = Opening::new(max);
    let mut conns = JoinSet::new();
    loop {
        let accepted = tokio::select! {
            _ = state.cancel.cancelled() => break,
            r = listener.accept() => r,
        };
        while conns.try_join_next().is_some() {}
        let (tcp, remote) = match accepted {
            Ok(a) => a,
            Err(e) => {
                log::warn!("gateway: accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let permit = match slots.clone().try_acquire_owned() {
            Ok(p) => p,
            Err(_) => {
                // Every slot is taken: the oldest connection still opening
                // makes room (none: wait for one to end, as the backlog does).
                if let Some(e) = opening.evict_oldest() {
                    evicted(&state, &e, "every connection slot is taken");
                }
                tokio::select! {
                    _ = state.cancel.cancelled() => break,
                    p = slots.clone().acquire_owned() => match p { Ok(p) => p, Err(_) => break },
                }
            }
        };
        let (pending, e) = opening.add(remote.ip());
        if let Some(e) = e {
            evicted(
                &state,
                &e,
                "its address holds a quarter of the slots in unfinished connections",
            );
        }
        let (state, acceptor) = (state.clone(), acceptor.clone());
        conns.spawn(async move {
            serve(state, acceptor, tcp, remote, pending).await;
            drop(permit);
        });
    }
    drop(listener);
    let drained = tokio::time::timeout(Duration::from_secs(3), async {
        while conns.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        conns.abort_all();
    }
}

/// Counts and logs (rate-limited) an opening connection dropped to make room.
fn evicted(state: &State, e: &Evicted, why: &str) {
    state
        .counters
        .refused_too_many_connections
        .fetch_add(1, Ordering::Relaxed);
    if let Some(more) = EVICTIONS_LOGGED.check() {
        log::warn!(
            "gateway: dropped an unfinished connection from {} (open {:?}, no request yet) \
             to make room: {why} (gateway.max_connections = {}){more}",
            e.addr,
            e.open_for,
            state.cfg.max_connections
        );
    }
}

async fn serve(
    state: Arc<State>,
    acceptor: TlsAcceptor,
    tcp: TcpStream,
    remote: SocketAddr,
    pending: Pending,
) {
    let _ = tcp.set_nodelay(true);
    let header_timeout = Duration::from_millis(state.cfg.header_timeout_ms.max(1));
    let idle = Duration::from_millis(state.cfg.idle_timeout_ms.max(1));
    let evict = pending.cancel.clone();
    let tls = tokio::select! {
        _ = state.cancel.cancelled() => return,
        _ = evict.cancelled() => return,
        r = tokio::time::timeout(header_timeout, acceptor.accept(tcp)) => r,
    };
    let tls = match tls {
        Ok(Ok(t)) => t,
        Ok(Err(e)) => {
            state.counters.refused_tls.fetch_add(1, Ordering::Relaxed);
            if let Some(more) = TLS_FAILURES_LOGGED.check() {
                log::info!("gateway: TLS handshake with {remote} failed: {e}{more}");
            }
            return;
        }
        Err(_) => {
            state.counters.timed_out.fetch_add(1, Ordering::Relaxed);
            log::debug!("gateway: TLS handshake with {remote} timed out");
            return;
        }
    };
    let cn = tls
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|c| c.first())
        .and_then(|c| tls::peer_cn(c));
    let activity = Activity::new();
    let io = Watched {
        inner: tls,
        activity: activity.clone(),
    };
    let client = Arc::new(super::reply::Client {
        cn,
        remote,
        activity: activity.clone(),
        opening: std::sync::Mutex::new(Some(pending)),
    });
    let st = state.clone();
    let service = service_fn(move |req| super::http::handle(st.clone(), client.clone(), req));
    let conn = http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(header_timeout)
        .serve_connection(TokioIo::new(io), service)
        .with_upgrades();
    tokio::pin!(conn);
    let watchdog = activity.idle(idle);
    tokio::select! {
        // Dropped to make room before its first request.
        _ = evict.cancelled() => {}
        _ = state.cancel.cancelled() => {
            conn.as_mut().graceful_shutdown();
            let _ = tokio::time::timeout(Duration::from_secs(1), conn).await;
        }
        r = &mut conn => {
            if let Err(e) = r {
                if e.is_timeout() {
                    state.counters.timed_out.fetch_add(1, Ordering::Relaxed);
                }
                log::debug!("gateway: connection from {remote} ended: {e}");
            }
        }
        _ = watchdog => {
            state.counters.timed_out.fetch_add(1, Ordering::Relaxed);
            log::info!("gateway: closed the connection of {remote}: idle for {idle:?}");
        }
    }
}

/// A stream that records when bytes last moved.
struct Watched<S> {
    inner: S,
    activity: Activity,
}

impl<S> Watched<S> {
    fn touch(&self) {
        self.activity.touch();
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Watched<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(r, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.touch();
        }
        r
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Watched<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            self.touch();
        }
        r
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}
