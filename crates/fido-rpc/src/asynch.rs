//! The async (tokio) client: one reader task per connection completes the
//! calls in flight, in whatever order the server answers them.

use crate::client::{call_message, cancel_message, decode_reply, CallOpts, Reply};
use crate::error::{CallError, RpcError};
use crate::frame::Frame;
use bytemuck::Pod;
use fido::{AsyncChannel, Domain, Msg};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tokio::sync::oneshot;

struct Inner {
    ch: AsyncChannel,
    domain: Domain,
    pending: Mutex<Pending>,
}

#[derive(Default)]
struct Pending {
    calls: HashMap<u64, oneshot::Sender<Msg>>,
    failed: Option<String>,
}

/// An async client of one service (create it inside a tokio runtime).
/// `Send + Sync`; calls from many tasks share the connection. Dropping a
/// call's future cancels it at the server.
pub struct AsyncClient {
    inner: Arc<Inner>,
    next_id: AtomicU64,
    reader: tokio::task::JoinHandle<()>,
}

impl Drop for AsyncClient {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

impl AsyncClient {
    /// Connects to `service` and starts the reader task on the current runtime.
    pub fn connect(domain: &Domain, service: &str) -> Result<AsyncClient, RpcError> {
        let ch = AsyncChannel::new(domain.connect(service)?)?;
        let inner = Arc::new(Inner { ch, domain: domain.clone(), pending: Mutex::new(Pending::default()) });
        let r = inner.clone();
        let reader = tokio::spawn(async move {
            loop {
                match r.ch.recv().await {
                    Ok(m) => {
                        let tx = r.pending.lock().calls.remove(&m.tag());
                        if let Some(tx) = tx {
                            let _ = tx.send(m);
                        }
                    }
                    Err(e) => {
                        let mut p = r.pending.lock();
                        p.failed = Some(e.to_string());
                        // Dropping the senders wakes every caller with an error.
                        p.calls.clear();
                        return;
                    }
                }
            }
        });
        Ok(AsyncClient { inner, next_id: AtomicU64::new(1), reader })
    }

    pub fn frame(&self) -> Result<Frame, RpcError> {
        Frame::new(self.inner.domain.arena())
    }

    pub fn set_wait(&self, w: fido::WaitStrategy) {
        self.inner.ch.channel().set_wait(w);
    }

    /// Whether the connection is still up.
    pub fn is_connected(&self) -> bool {
        self.inner.ch.channel().is_open() && self.inner.pending.lock().failed.is_none()
    }

    /// A call (generated stubs use this).
    pub async fn call<R: Pod, E: Pod + std::fmt::Debug>(
        &self,
        method: u32,
        sig: u32,
        frame: Frame,
        root: &[u8],
        opts: &CallOpts,
    ) -> Result<Reply<R>, CallError<E>> {
        let msg = self.call_raw(method, sig, frame, root, opts).await?;
        decode_reply(msg)
    }

    pub async fn call_oneway(&self, method: u32, sig: u32, frame: Frame, root: &[u8]) -> Result<(), RpcError> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let m = call_message(frame, method, sig, id, true, 0, root)?;
        self.inner.ch.send(m).await.map_err(|e| RpcError::ServerGone(e.error.to_string()))
    }

    pub async fn call_raw(&self, method: u32, sig: u32, frame: Frame, root: &[u8], opts: &CallOpts) -> Result<Msg, RpcError> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let deadline_ns = opts.timeout.map(|t| crate::wire::monotonic_ns() + t.as_nanos() as u64).unwrap_or(0);
        let m = call_message(frame, method, sig, id, false, deadline_ns, root)?;
        let (tx, rx) = oneshot::channel();
        {
            let mut p = self.inner.pending.lock();
            if let Some(why) = &p.failed {
                return Err(RpcError::ServerGone(why.clone()));
            }
            p.calls.insert(id, tx);
        }
        // From here on, a dropped future tells the server to cancel.
        let guard = CancelOnDrop { inner: &self.inner, id, armed: true };
        self.inner.ch.send(m).await.map_err(|e| RpcError::ServerGone(e.error.to_string()))?;
        let wait = async {
            match rx.await {
                Ok(m) => Ok(m),
                Err(_) => Err(RpcError::ServerGone(self.inner.pending.lock().failed.clone().unwrap_or_else(|| "connection closed".into()))),
            }
        };
        let r = match opts.timeout {
            Some(t) => match tokio::time::timeout(t, wait).await {
                Ok(r) => r,
                Err(_) => return Err(RpcError::DeadlineExceeded), // guard cancels
            },
            None => wait.await,
        };
        let mut guard = guard;
        guard.armed = r.is_err();
        r
    }
}

/// Cancels a call whose future was dropped (or timed out) before its reply.
struct CancelOnDrop<'a> {
    inner: &'a Inner,
    id: u64,
    armed: bool,
}

impl Drop for CancelOnDrop<'_> {
    fn drop(&mut self) {
        let was_pending = self.inner.pending.lock().calls.remove(&self.id).is_some();
        if self.armed && was_pending {
            if let Some(m) = cancel_message(&self.inner.domain, self.id) {
                let _ = self.inner.ch.channel().try_send(m);
            }
        }
    }
}
