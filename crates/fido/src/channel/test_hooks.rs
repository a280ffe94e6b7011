//! What a lying peer does to a channel, for the adversarial tests: only
//! with the feature `test-hooks`, which only this crate's tests enable.

use super::Channel;
use crate::error::{Error, Result};
use fido_ring::Descriptor;
use std::os::fd::OwnedFd;
use std::sync::atomic::Ordering;

impl Channel {
    /// Test hook: publishes a raw descriptor as a misbehaving peer would (no
    /// validation, no bookkeeping). Used by the adversarial tests.
    #[doc(hidden)]
    pub fn __send_raw_descriptor(&self, desc: Descriptor) -> Result<()> {
        let mut tx = self.shared.tx.lock();
        // The only push error is a full ring.
        tx.ring.push(&desc).map_err(|_| Error::WouldBlock)?;
        tx.ring.publish()?;
        Ok(())
    }

    /// Test hook: overwrites our published indices as a lying peer would
    /// (`data`: the descriptor publish index; `releases`: the release index),
    /// and rings the peer. Used by the adversarial tests.
    #[doc(hidden)]
    pub fn __forge_indices(&self, data: Option<u64>, releases: Option<u64>) {
        let local = self.shared.local;
        if let Some(v) = data {
            local.data_prod().store(v, Ordering::Release);
        }
        if let Some(v) = releases {
            local.rel_prod().store(v, Ordering::Release);
        }
        self.shared.tx.lock().ring.wake_peer();
        self.shared.releaser.lock().ring.wake_peer();
    }

    /// Test hook: a duplicate of the ring end of the peer's data doorbell —
    /// exactly what a peer holds of ours. Used by the adversarial tests.
    #[doc(hidden)]
    pub fn __peer_data_bell(&self) -> std::io::Result<OwnedFd> {
        let tx = self.shared.tx.lock();
        let bell = tx.ring.peer_data_bell().as_socket().ok_or_else(|| std::io::Error::other("the peer's doorbell is a device register"))?;
        Ok(rustix::io::fcntl_dupfd_cloexec(bell, 0)?)
    }
}

