//! A link call driven on the calling thread: [`on_this_thread`] polls a future of the
//! domain's runtime (its sockets, its timers) on a request's own thread, so that a client's
//! import across nodes costs no hand-off to a runtime worker and back; what wakes the
//! thread is the runtime's I/O driver noticing the owner's answer.
//!
//! Abandon-safe by construction of what it drives: a call takes its link out of the
//! node's slot for the time of the call ([`super::dial`]), so a call given up mid-frame
//! (its deadline passed) drops that link, closed, and the next call dials anew.

use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::thread::Thread;
use std::time::Duration;

/// Wakes the thread that drives the call.
struct Unpark(Thread);

impl Wake for Unpark {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.0.unpark();
    }
}

/// Runs `call` to its end on this thread within `deadline`, in the context of `runtime`
/// (the sockets and timers it makes are that runtime's, driven by its workers); `None`
/// when the deadline passed first, `call` dropped where it stood.
///
/// For a synchronous handler's thread only: it blocks the thread (and whatever runtime
/// of its own the thread runs, as any synchronous handler does). Never on one of
/// `runtime`'s workers, which would wait for itself.
pub fn on_this_thread<F: Future>(runtime: &tokio::runtime::Handle, deadline: Duration, call: F) -> Option<F::Output> {
    let _in = runtime.enter();
    // Made inside the runtime's context: the deadline is its timer's. Unconstrained: a
    // thread that runs a task of its own (a connection's, answering request after request
    // in one poll) may have spent that task's coop budget, and a call held to it would be
    // told to yield, woken at once, and polled again, forever.
    let mut call = pin!(tokio::task::unconstrained(tokio::time::timeout(deadline, call)));
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    loop {
        match call.as_mut().poll(&mut cx) {
            Poll::Ready(r) => return r.ok(),
            // A wake-up that came before the park makes it return at once; one that did not
            // come from the call (a stray unpark) polls once more for nothing.
            Poll::Pending => std::thread::park(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap()
    }

    #[test]
    fn a_call_on_the_runtimes_sockets_and_timers_ends_on_the_calling_thread() {
        let rt = runtime();
        let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
        let addr = listener.local_addr().unwrap();
        rt.spawn(async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let (mut s, _) = listener.accept().await.unwrap();
            let mut b = [0u8; 4];
            s.read_exact(&mut b).await.unwrap();
            tokio::time::sleep(Duration::from_millis(20)).await;
            s.write_all(&b).await.unwrap();
        });
        let caller = std::thread::current().id();
        let got = on_this_thread(rt.handle(), Duration::from_secs(5), async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
            s.write_all(b"ping").await.unwrap();
            let mut b = [0u8; 4];
            s.read_exact(&mut b).await.unwrap();
            (b, std::thread::current().id())
        });
        assert_eq!(got, Some((*b"ping", caller)));
    }

    #[test]
    fn a_call_past_its_deadline_is_dropped_where_it_stood() {
        let rt = runtime();
        struct Dropped(std::sync::mpsc::Sender<()>);
        impl Drop for Dropped {
            fn drop(&mut self) {
                let _ = self.0.send(());
            }
        }
        let (tx, rx) = std::sync::mpsc::channel();
        let held = Dropped(tx);
        let got = on_this_thread(rt.handle(), Duration::from_millis(50), async move {
            let _held = held;
            std::future::pending::<()>().await;
        });
        assert_eq!(got, None);
        rx.try_recv().expect("what the call held went with it");
    }

    /// Runs `handler` as a connection's thread does: inside a current-thread runtime's
    /// task, with the domain runtime's handle.
    fn in_a_connections_task<T>(handler: impl FnOnce(&tokio::runtime::Handle) -> T) -> T {
        let rt = runtime();
        let handle = rt.handle().clone();
        let local = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        local.block_on(async move { handler(&handle) })
    }

    #[test]
    fn it_runs_from_a_thread_that_runs_a_runtime_of_its_own() {
        let got = in_a_connections_task(|rt| {
            on_this_thread(rt, Duration::from_secs(5), async {
                tokio::time::sleep(Duration::from_millis(5)).await;
                7
            })
        });
        assert_eq!(got, Some(7));
    }

    #[test]
    fn a_call_is_not_held_to_the_budget_of_the_task_the_thread_runs() {
        // A connection's task answering one request after another in one poll spends the
        // coop budget tokio gives each poll; a call driven there must still end.
        let got = in_a_connections_task(|rt| {
            (0..3)
                .map(|_| {
                    on_this_thread(rt, Duration::from_secs(2), async {
                        for _ in 0..200 {
                            tokio::task::consume_budget().await;
                        }
                    })
                })
                .collect::<Vec<_>>()
        });
        assert_eq!(got, vec![Some(()); 3]);
    }
}
