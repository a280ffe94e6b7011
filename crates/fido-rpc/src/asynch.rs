//! The async (tokio) client: one reader task per connection completes the
//! calls in flight, in whatever order the server answers them.

use crate::client::{call_message, cancel_message, decode_reply, next_call_id, CallOpts, Reply};
use crate::error::{CallError, RpcError};
use crate::frame::Frame;
use bytemuck::Pod;
use fido::{AsyncChannel, Domain, Msg};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;
use tokio::sync::oneshot;

struct Inner {
    ch: AsyncChannel,
    pending: Mutex<Pending>,
}

#[derive(Default)]
struct Pending {
    calls: HashMap<u64, oneshot::Sender<Msg>>,
    failed: Option<String>,
}

/// One connection and its reader task (aborted when the last user drops it).
struct Conn {
    inner: Arc<Inner>,
    reader: tokio::task::JoinHandle<()>,
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

impl Conn {
    fn open(domain: &Domain, service: &str, wait: Option<fido::WaitStrategy>) -> Result<Conn, RpcError> {
        let ch = domain.connect(service)?;
        if let Some(w) = wait {
            ch.set_wait(w);
        }
        let ch = AsyncChannel::new(ch)?;
        let inner = Arc::new(Inner { ch, pending: Mutex::new(Pending::default()) });
        let r = inner.clone();
        let reader = tokio::spawn(async move {
            loop {
                match r.ch.recv().await {
                    Ok(m) => {
                        let tx = r.pending.lock().calls.remove(&m.tag());
                        if let Some(tx) = tx {
                            let _ = tx.send(m);
                        }
                        // else: a late reply to an abandoned call; dropped.
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
        Ok(Conn { inner, reader })
    }
    fn is_up(&self) -> bool {
        self.inner.ch.channel().is_open() && self.inner.pending.lock().failed.is_none()
    }
}

/// An async client of one service (create it inside a tokio runtime).
/// `Send + Sync`; calls from many tasks share the connection and complete in
/// any order. Dropping a call's future cancels it at the server. If the
/// server dies, calls in flight fail with [`RpcError::ServerGone`] and the
/// next call connects again (a restarted server under the same name).
pub struct AsyncClient {
    domain: Domain,
    service: String,
    conn: Mutex<Arc<Conn>>,
    wait: Mutex<Option<fido::WaitStrategy>>,
}

impl AsyncClient {
    /// Connects to `service` and starts the reader task on the current runtime.
    pub fn connect(domain: &Domain, service: &str) -> Result<AsyncClient, RpcError> {
        let conn = Conn::open(domain, service, None)?;
        Ok(AsyncClient {
            domain: domain.clone(),
            service: service.into(),
            conn: Mutex::new(Arc::new(conn)),
            wait: Mutex::new(None),
        })
    }

    pub fn frame(&self) -> Result<Frame, RpcError> {
        // As `Client::frame`: reclaim finished calls' arguments first.
        let _ = self.conn.lock().inner.ch.channel().reap_if_holding(crate::REAP_ABOVE);
        Frame::new(self.domain.arena())
    }

    /// How the reader waits for replies (see [`crate::Client::set_wait`]).
    pub fn set_wait(&self, w: fido::WaitStrategy) {
        *self.wait.lock() = Some(w);
        self.conn.lock().inner.ch.channel().set_wait(w);
    }

    /// Whether the current connection is up.
    pub fn is_connected(&self) -> bool {
        self.conn.lock().is_up()
    }

    /// The current connection, or a new one if it failed.
    fn current(&self) -> Result<Arc<Conn>, RpcError> {
        let mut g = self.conn.lock();
        if !g.is_up() {
            *g = Arc::new(Conn::open(&self.domain, &self.service, *self.wait.lock())?);
        }
        Ok(g.clone())
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
        let conn = self.current()?;
        let id = next_call_id();
        let m = call_message(frame, method, sig, id, true, 0, root)?;
        conn.inner.ch.send(m).await.map_err(|e| RpcError::ServerGone(e.error.to_string()))
    }

    pub async fn call_raw(&self, method: u32, sig: u32, frame: Frame, root: &[u8], opts: &CallOpts) -> Result<Msg, RpcError> {
        let conn = self.current()?;
        let inner = &conn.inner;
        let id = next_call_id();
        let deadline_ns = opts.timeout.map(|t| crate::wire::monotonic_ns() + t.as_nanos() as u64).unwrap_or(0);
        let m = call_message(frame, method, sig, id, false, deadline_ns, root)?;
        let (tx, rx) = oneshot::channel();
        {
            let mut p = inner.pending.lock();
            if let Some(why) = &p.failed {
                return Err(RpcError::ServerGone(why.clone()));
            }
            p.calls.insert(id, tx);
        }
        // From here on, a dropped future tells the server to cancel.
        let mut guard = CancelOnDrop { inner, id, armed: true };
        inner.ch.send(m).await.map_err(|e| RpcError::ServerGone(e.error.to_string()))?;
        let wait = async {
            match rx.await {
                Ok(m) => Ok(m),
                Err(_) => Err(RpcError::ServerGone(inner.pending.lock().failed.clone().unwrap_or_else(|| "connection closed".into()))),
            }
        };
        let r = match opts.timeout {
            Some(t) => match tokio::time::timeout(t, wait).await {
                Ok(r) => r,
                Err(_) => return Err(RpcError::DeadlineExceeded), // the guard cancels
            },
            None => wait.await,
        };
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
            let _ = self.inner.ch.channel().try_send(cancel_message(self.id));
        }
    }
}
