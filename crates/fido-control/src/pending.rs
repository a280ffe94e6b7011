//! One request's answer on its way: where the reader thread puts it and how
//! the caller waits for it (blocking, with a deadline, by polling, as a
//! `Future`, or through an eventfd in an epoll loop).

use crate::error::{ControlError, Result};
use crate::session::Shared;
use fido_proto::Reply;
use parking_lot::{Condvar, Mutex};
use std::future::Future;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

/// The broker's answer to one request: the reply and the descriptors that
/// came with it, or why there is none.
pub type Answer = Result<(Reply, Vec<OwnedFd>)>;

#[derive(Default)]
struct SlotState {
    answer: Option<Answer>,
    taken: bool,
    waker: Option<Waker>,
    /// An eventfd written once the answer is in (made on demand).
    bell: Option<OwnedFd>,
}

impl SlotState {
    fn done(&self) -> bool {
        self.answer.is_some() || self.taken
    }

    fn take(&mut self) -> Answer {
        match self.answer.take() {
            Some(a) => {
                self.taken = true;
                a
            }
            None => Err(ControlError::AlreadyTaken),
        }
    }
}

/// Where the reader thread puts the answer to one request.
#[derive(Default)]
pub(crate) struct Slot {
    state: Mutex<SlotState>,
    cv: Condvar,
}

impl Slot {
    /// Stores the answer and wakes whoever waits; only the first answer counts.
    pub(crate) fn fill(&self, answer: Answer) {
        let mut st = self.state.lock();
        if st.done() {
            return;
        }
        st.answer = Some(answer);
        if let Some(bell) = &st.bell {
            let _ = rustix::io::write(bell, &1u64.to_ne_bytes());
        }
        if let Some(w) = st.waker.take() {
            w.wake();
        }
        self.cv.notify_all();
    }
}

/// A request sent and not yet answered. Dropping it forgets the request (a
/// reply that comes later is ignored); it does not cancel anything at the
/// broker.
pub struct Pending {
    pub(crate) shared: Arc<Shared>,
    pub(crate) id: u64,
    pub(crate) slot: Arc<Slot>,
}

impl std::fmt::Debug for Pending {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pending").field("request", &self.id).finish()
    }
}

impl Pending {
    /// The request's id on the wire.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Blocks until the answer comes, however long that is (losing the broker
    /// ends the wait with [`ControlError::Lost`]).
    pub fn wait(self) -> Answer {
        let mut st = self.slot.state.lock();
        while !st.done() {
            self.slot.cv.wait(&mut st);
        }
        st.take()
    }

    /// Waits up to `timeout`; `None` if the answer has not come yet.
    pub fn wait_timeout(&mut self, timeout: Duration) -> Option<Answer> {
        let deadline = Instant::now() + timeout;
        let mut st = self.slot.state.lock();
        while !st.done() {
            if self.slot.cv.wait_until(&mut st, deadline).timed_out() {
                break;
            }
        }
        st.done().then(|| st.take())
    }

    /// The answer if it came ([`ControlError::AlreadyTaken`] after it was taken once).
    pub fn try_take(&mut self) -> Option<Answer> {
        let mut st = self.slot.state.lock();
        st.done().then(|| st.take())
    }

    /// An eventfd that becomes readable when the answer comes, for poll/epoll.
    /// It stays readable, and is closed with the `Pending`.
    pub fn ready_fd(&self) -> Result<RawFd> {
        let mut st = self.slot.state.lock();
        if st.bell.is_none() {
            let fd = rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK)?;
            if st.done() {
                let _ = rustix::io::write(&fd, &1u64.to_ne_bytes());
            }
            st.bell = Some(fd);
        }
        Ok(st.bell.as_ref().map(|b| b.as_raw_fd()).expect("just set"))
    }
}

impl Future for Pending {
    type Output = Answer;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Answer> {
        let mut st = self.slot.state.lock();
        if st.done() {
            return Poll::Ready(st.take());
        }
        st.waker = Some(cx.waker().clone());
        Poll::Pending
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        // Nobody will read the answer: the reader need not keep the slot.
        self.shared.forget(self.id);
    }
}
