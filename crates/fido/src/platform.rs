//! Where this domain runs: a host process, or a VM guest. The one place that
//! knows the difference, so channels and the domain stay the same code.
//!
//! On the host, doorbells are socket pairs, peer arenas are sealed memfds and
//! a peer's futex words are shared with it. In a guest (crate `fido-guest`),
//! our doorbells are the eventfds our doorbell device's interrupts arrive on,
//! a peer's ring end is a device register, a peer's arena is a PCI BAR the
//! VM's supervisor hot-plugged read-only, and no futex crosses the boundary.

use crate::error::Result;
use fido_ring::doorbell::{self, Doorbell, RingEnd};
use fido_shm::{AddressSpace, Mapping};
use std::os::fd::OwnedFd;
use std::sync::Arc;

#[derive(Clone)]
pub(crate) enum Platform {
    Host,
    /// Inside a VM guest, through its supervisor.
    Guest(Arc<fido_guest::Guest>),
}

impl Platform {
    /// A fresh doorbell of ours: we keep the wait end, the ring end goes to the peer.
    pub(crate) fn new_bell(&self) -> Result<Doorbell> {
        Ok(match self {
            Platform::Host => doorbell::new_doorbell()?,
            Platform::Guest(g) => g.new_bell().map_err(guest_error)?,
        })
    }

    /// What a peer's ring-end descriptor from the broker rings through.
    pub(crate) fn ring_end(&self, fd: OwnedFd) -> Result<RingEnd> {
        Ok(match self {
            Platform::Host => RingEnd::socket(fd),
            Platform::Guest(g) => g.ring_end(fd).map_err(guest_error)?,
        })
    }

    /// Maps a peer's arena read-only in `slot`: a checked sealed memfd on the
    /// host, a hot-plugged BAR in a guest.
    pub(crate) fn map_peer(&self, space: &AddressSpace, slot: u32, owner: u64, fd: OwnedFd, len: u64) -> Result<Arc<Mapping>> {
        Ok(match self {
            Platform::Host => space.map_peer(slot, owner, fd, len)?,
            Platform::Guest(_) => space.map_peer_device(slot, owner, fd, len)?,
        })
    }

    /// Flags for our ring blocks: a guest says it lives under another kernel.
    pub(crate) fn block_flags(&self) -> u64 {
        match self {
            Platform::Host => 0,
            Platform::Guest(_) => fido_ring::FLAG_OTHER_KERNEL,
        }
    }

    /// Whether futexes on a peer's words can reach it: both of us under one kernel.
    pub(crate) fn futex_reaches(&self, peer: &fido_ring::PeerBlock) -> bool {
        matches!(self, Platform::Host) && !peer.other_kernel()
    }

    pub(crate) fn is_guest(&self) -> bool {
        !matches!(self, Platform::Host)
    }
}

fn guest_error(e: fido_guest::GuestError) -> crate::error::Error {
    match e {
        fido_guest::GuestError::Io(io) => io.into(),
        other => crate::error::Error::broker_protocol(format!("VM guest: {other}")),
    }
}
