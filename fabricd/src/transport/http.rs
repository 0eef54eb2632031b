//! The metrics endpoint: a tiny HTTP/1.1 responder on a loopback TCP socket. `GET /metrics`
//! answers the page of [`metrics`](crate::metrics); anything else answers 404 (or 400 when
//! the request head is malformed or too big). One request per connection, then close.
//!
//! Any local user can connect, so idle connections must not keep scrapes out: at most
//! [`MAX_CONNECTIONS`] are open, and when they are all taken a new connection closes the
//! oldest one still waiting for its request head (a scraper sends its head at once; an
//! idle client is the one that waits). A head must arrive within [`READ_TIMEOUT`].

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::daemon::Daemon;

/// The largest request head read; a bigger one is answered 400.
pub const MAX_HEAD: usize = 8 << 10;
/// A client must send its whole request head within this long.
pub const READ_TIMEOUT: Duration = Duration::from_secs(2);
/// A client must take the answer within this long.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long, and how much, input after the answer is read before closing.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(1);
const DRAIN_MAX: usize = 64 << 10;
/// Connections open at once (descriptors kept back for them: `server::RESERVED_FDS`).
/// Past it, the oldest connection still waiting for its head is closed for the new one.
pub const MAX_CONNECTIONS: usize = 64;

/// The connections open, and those still waiting for their head, oldest first.
#[derive(Debug, Default)]
struct Open {
    count: usize,
    next_id: u64,
    waiting: std::collections::VecDeque<(u64, CancellationToken)>,
}

/// Counts a connection open until dropped.
struct Slot {
    open: Arc<std::sync::Mutex<Open>>,
    id: u64,
    /// What closes it for a newer one.
    cancel: CancellationToken,
}

impl Slot {
    /// The connection's head has come: it can no longer be closed for a newer one while
    /// it is answered.
    fn head_read(&self) {
        lock(&self.open).waiting.retain(|(id, _)| *id != self.id);
    }

    /// The answer is written; only the drain of what the client still sends is left: the
    /// connection may be closed for a newer one again, before any still waiting for its
    /// head (clients that keep answered connections open cannot keep scrapes out).
    fn answered(&self) {
        lock(&self.open).waiting.push_front((self.id, self.cancel.clone()));
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut o = lock(&self.open);
        o.count -= 1;
        o.waiting.retain(|(id, _)| *id != self.id);
    }
}

fn lock(open: &std::sync::Mutex<Open>) -> std::sync::MutexGuard<'_, Open> {
    open.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Takes a slot for a new connection, closing the oldest waiting one when all are taken;
/// `None` when every open connection is past its head (being answered).
fn admit(open: &Arc<std::sync::Mutex<Open>>) -> Option<(Slot, CancellationToken)> {
    let mut o = lock(open);
    if o.count >= MAX_CONNECTIONS {
        let (_, oldest) = o.waiting.pop_front()?;
        // Its task ends at once and gives its count back; until then one more is open.
        oldest.cancel();
    }
    o.count += 1;
    o.next_id += 1;
    let (id, cancel) = (o.next_id, CancellationToken::new());
    o.waiting.push_back((id, cancel.clone()));
    Some((Slot { open: open.clone(), id, cancel: cancel.clone() }, cancel))
}

/// Why the endpoint could not be started.
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    /// `metrics.listen` is not `host:port`.
    #[error("metrics.listen {0:?} is not host:port")]
    Address(String),
    /// The address could not be bound (in use, not local).
    #[error("cannot listen for metrics on {addr} (metrics.listen; \"\" disables the endpoint)")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// Binds `listen` (already validated as loopback by the configuration).
pub fn bind(listen: &str) -> Result<TcpListener, HttpError> {
    let addr: SocketAddr = listen.parse().map_err(|_| HttpError::Address(listen.to_owned()))?;
    let bind = |addr| -> std::io::Result<TcpListener> {
        let l = std::net::TcpListener::bind(addr)?;
        l.set_nonblocking(true)?;
        TcpListener::from_std(l)
    };
    bind(addr).map_err(|source| HttpError::Bind { addr, source })
}

/// Serves scrapes on `listener` until `shutdown` is cancelled; then waits (briefly) for the
/// scrapes in flight.
pub async fn serve(listener: TcpListener, daemon: Arc<Daemon>, shutdown: CancellationToken) {
    let tracker = TaskTracker::new();
    let open = Arc::new(std::sync::Mutex::new(Open::default()));
    loop {
        let accepted = tokio::select! {
            () = shutdown.cancelled() => break,
            r = listener.accept() => r,
        };
        let stream = match accepted {
            Ok((s, _)) => s,
            Err(e) => {
                tracing::warn!(error = %e, "metrics accept failed; pausing 100 ms");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Some((slot, closed)) = admit(&open) else {
            tracing::debug!("metrics connections all being answered; closing a new connection");
            continue;
        };
        let daemon = daemon.clone();
        tracker.spawn(async move {
            tokio::select! {
                () = closed.cancelled() => tracing::debug!("metrics connection idle while others wait; closed"),
                () = answer(stream, &daemon, &slot) => {}
            }
        });
    }
    drop(listener);
    tracker.close();
    let _ = tokio::time::timeout(WRITE_TIMEOUT, tracker.wait()).await;
}

/// What a request head asks for.
#[derive(Debug, PartialEq, Eq)]
pub enum Route {
    /// `GET /metrics` (or `HEAD`).
    Metrics {
        /// Whether only the head is wanted.
        head_only: bool,
    },
    /// Any other method or path.
    NotFound,
    /// Not an HTTP request head.
    Bad,
}

/// Routes a request head (the bytes before the blank line).
pub fn route(head: &[u8]) -> Route {
    let Ok(text) = std::str::from_utf8(head) else { return Route::Bad };
    let line = text.split("\r\n").next().unwrap_or("");
    let mut parts = line.split(' ');
    let (Some(method), Some(target), Some(version), None) = (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Route::Bad;
    };
    if !version.starts_with("HTTP/1.") {
        return Route::Bad;
    }
    let path = target.split('?').next().unwrap_or(target);
    match (method, path) {
        ("GET", "/metrics") => Route::Metrics { head_only: false },
        ("HEAD", "/metrics") => Route::Metrics { head_only: true },
        _ => Route::NotFound,
    }
}

/// Reads up to the end of the head; `None` when the peer went, stalled or sent too much.
async fn read_head(stream: &mut TcpStream) -> Option<Vec<u8>> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    let mut searched = 0;
    loop {
        if let Some(end) = blank_line(&buf, &mut searched) {
            buf.truncate(end);
            return Some(buf);
        }
        if buf.len() >= MAX_HEAD {
            return None;
        }
        let n = stream.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// Where the head's blank line starts in `buf`, looking only past `searched` (and the
/// three bytes before it, where the line may have begun), which it moves on: a head that
/// trickles in a byte at a time is scanned once, not once per read.
fn blank_line(buf: &[u8], searched: &mut usize) -> Option<usize> {
    let from = searched.saturating_sub(3);
    *searched = buf.len();
    buf.get(from..)?.windows(4).position(|w| w == b"\r\n\r\n").map(|at| from + at)
}

async fn answer(mut stream: TcpStream, daemon: &Daemon, slot: &Slot) {
    let head = tokio::time::timeout(READ_TIMEOUT, read_head(&mut stream)).await.ok().flatten();
    slot.head_read();
    let (status, ctype, body, head_only) = match head.as_deref().map_or(Route::Bad, route) {
        Route::Metrics { head_only } => {
            ("200 OK", "text/plain; version=0.0.4; charset=utf-8", daemon.metrics_page(), head_only)
        }
        Route::NotFound => {
            ("404 Not Found", "text/plain; charset=utf-8", "not found; try /metrics\n".to_owned(), false)
        }
        Route::Bad => ("400 Bad Request", "text/plain; charset=utf-8", "bad request\n".to_owned(), false),
    };
    let mut out = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    if !head_only {
        out.extend_from_slice(body.as_bytes());
    }
    let _ = tokio::time::timeout(WRITE_TIMEOUT, async {
        stream.write_all(&out).await?;
        stream.shutdown().await
    })
    .await;
    slot.answered();
    // Closing with unread input would reset the connection, and the client could lose the
    // answer; read what is left (bounded) until the client closes.
    let _ = tokio::time::timeout(DRAIN_TIMEOUT, async {
        let mut buf = [0u8; 4096];
        let mut left = DRAIN_MAX;
        while left > 0 {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => left = left.saturating_sub(n),
            }
        }
    })
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A head that arrives a byte at a time is found where a whole one is, each byte
    /// looked at a bounded number of times (before, every read scanned the whole head).
    #[test]
    fn a_trickled_head_is_found_scanning_each_byte_a_few_times() {
        let head = format!("GET /metrics HTTP/1.1\r\nX-Pad: {}\r\n\r\nrest", "a".repeat(8000));
        let want = head.find("\r\n\r\n");
        let (mut buf, mut searched, mut scanned, mut found) = (Vec::new(), 0usize, 0usize, None);
        for &b in head.as_bytes() {
            buf.push(b);
            scanned += buf.len() - searched.saturating_sub(3).min(buf.len());
            if let Some(end) = blank_line(&buf, &mut searched) {
                found = Some(end);
                break;
            }
        }
        assert_eq!(found, want);
        assert!(scanned <= 4 * head.len(), "{scanned} bytes scanned for a head of {}", head.len());
        assert_eq!(blank_line(b"GET / HTTP/1.1\r\n\r\n", &mut 0), Some(14));
        assert_eq!(blank_line(b"GET / HTTP/1.1\r\n", &mut 0), None);
    }

    #[test]
    fn a_new_connection_closes_the_oldest_waiting_one_when_all_are_taken() {
        let open = Arc::new(std::sync::Mutex::new(Open::default()));
        let mut held: Vec<_> = (0..MAX_CONNECTIONS).map(|_| admit(&open).unwrap()).collect();
        // The first has its head: it is answered, not closed for others.
        held[0].0.head_read();
        let (new, _) = admit(&open).unwrap();
        assert!(!held[0].1.is_cancelled());
        assert!(held[1].1.is_cancelled(), "the oldest waiting one is closed");
        assert!(held[2..].iter().all(|(_, c)| !c.is_cancelled()));
        // Its task ends: the count is back to the limit.
        drop(held.remove(1));
        assert_eq!(lock(&open).count, MAX_CONNECTIONS);
        // All past their heads: a new one is closed instead.
        for (s, _) in &held {
            s.head_read();
        }
        new.head_read();
        assert!(admit(&open).is_none());
        // One answered (only draining): closed first for the next one.
        held[3].0.answered();
        let (newer, _) = admit(&open).unwrap();
        assert!(held[3].1.is_cancelled(), "the answered one is closed for a new one");
        drop(held.remove(3));
        drop((held, new, newer));
        assert_eq!(lock(&open).count, 0);
    }

    #[test]
    fn routes_get_metrics_and_refuses_the_rest() {
        assert_eq!(route(b"GET /metrics HTTP/1.1\r\nHost: x"), Route::Metrics { head_only: false });
        assert_eq!(route(b"GET /metrics?x=1 HTTP/1.0"), Route::Metrics { head_only: false });
        assert_eq!(route(b"HEAD /metrics HTTP/1.1"), Route::Metrics { head_only: true });
        assert_eq!(route(b"GET / HTTP/1.1"), Route::NotFound);
        assert_eq!(route(b"POST /metrics HTTP/1.1"), Route::NotFound);
        assert_eq!(route(b"GET /metrics"), Route::Bad);
        assert_eq!(route(b"GET /metrics SPDY/3"), Route::Bad);
        assert_eq!(route(b"\xff\xfe"), Route::Bad);
    }
}
