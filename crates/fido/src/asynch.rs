//! The async flavour (feature `tokio`): the same channel, waiting on its
//! doorbells through tokio's reactor instead of blocking a thread.
//!
//! The protocol is the blocking one: try, announce the sleep in our sleep word,
//! try again, then await the doorbell (its wait end registered with epoll). A
//! peer that dies makes its liveness socket readable, which wakes us too.

use crate::channel::{Channel, Message, Msg, SendError};
use crate::error::{Error, Result};
use std::os::fd::{AsFd, OwnedFd};
use std::time::Duration;
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

/// Disarms a sleep word when the waiting future finishes or is cancelled, so
/// a dropped `recv`/`send` never leaves the peer ringing for nobody.
struct Armed<'a> {
    channel: &'a Channel,
    rx: bool,
}

impl Drop for Armed<'_> {
    fn drop(&mut self) {
        if self.rx {
            self.channel.disarm_rx();
        } else {
            self.channel.disarm_tx();
        }
    }
}

/// A [`Channel`] driven by tokio. Create it inside a tokio runtime.
pub struct AsyncChannel {
    channel: Channel,
    data: AsyncFd<OwnedFd>,
    space: AsyncFd<OwnedFd>,
    liveness: AsyncFd<OwnedFd>,
}

/// Registers a private duplicate of `fd` with the current runtime's reactor.
fn register(fd: std::os::fd::BorrowedFd<'_>) -> Result<AsyncFd<OwnedFd>> {
    let owned = rustix::io::fcntl_dupfd_cloexec(fd, 0)?;
    // SAFETY: `owned` is a fresh descriptor that the AsyncFd takes ownership
    // of; OwnedFd::as_raw_fd always returns it, and nothing else closes it.
    let afd = unsafe { AsyncFd::register_with_interest(owned, Interest::READABLE) }.map_err(|e| Error::Io(e.into()))?;
    Ok(afd)
}

impl AsyncChannel {
    /// Wraps a channel; registers its doorbells with the current runtime.
    pub fn new(channel: Channel) -> Result<AsyncChannel> {
        let data = register(channel.data_doorbell())?;
        let space = register(channel.space_doorbell())?;
        let liveness = register(channel.liveness())?;
        Ok(AsyncChannel { channel, data, space, liveness })
    }

    /// The underlying channel (for the non-waiting calls).
    pub fn channel(&self) -> &Channel {
        &self.channel
    }

    pub fn into_inner(self) -> Channel {
        self.channel
    }

    /// Receives the next message.
    pub async fn recv(&self) -> Result<Msg> {
        loop {
            if let Some(m) = self.channel.try_recv()? {
                return Ok(m);
            }
            if !self.channel.arm_rx() {
                continue;
            }
            let armed = Armed { channel: &self.channel, rx: true };
            // While forwarded messages are in flight, their releases must keep
            // flowing upstream: wake up now and then to collect them.
            // In a VM guest, a doorbell is an emulated interrupt that can be
            // lost: look again now and then (fido_ring::wait::GUEST_RECHECK).
            let tick = if self.channel.forwarded_in_flight() {
                Duration::from_micros(200)
            } else {
                self.channel.doorbell_recheck().unwrap_or(Duration::from_secs(3600))
            };
            tokio::select! {
                g = self.data.readable() => {
                    if let Ok(mut g) = g {
                        fido_ring::doorbell::drain(self.data.get_ref().as_fd());
                        g.clear_ready();
                    }
                }
                g = self.liveness.readable() => {
                    if let Ok(mut g) = g {
                        g.clear_ready();
                    }
                    drop(armed);
                    if let Some(m) = self.channel.try_recv()? {
                        return Ok(m);
                    }
                    self.channel.note_peer_hangup();
                    return self.channel.try_recv()?.ok_or(Error::Closed);
                }
                _ = tokio::time::sleep(tick) => {}
            }
        }
    }

    /// Sends a message, awaiting window space.
    pub async fn send(&self, msg: impl Into<Message>) -> std::result::Result<(), SendError> {
        let mut msg = msg.into();
        loop {
            match self.channel.try_send(msg) {
                Err(SendError { error: Error::WouldBlock, message }) => msg = message,
                other => return other,
            }
            if !self.channel.arm_tx() {
                continue;
            }
            let _armed = Armed { channel: &self.channel, rx: false };
            let tick = self.channel.doorbell_recheck().unwrap_or(Duration::from_secs(3600));
            tokio::select! {
                g = self.space.readable() => {
                    if let Ok(mut g) = g {
                        fido_ring::doorbell::drain(self.space.get_ref().as_fd());
                        g.clear_ready();
                    }
                }
                g = self.liveness.readable() => {
                    if let Ok(mut g) = g {
                        g.clear_ready();
                    }
                    self.channel.note_peer_hangup();
                }
                _ = tokio::time::sleep(tick) => {}
            }
        }
    }
}
