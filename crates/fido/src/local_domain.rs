//! What a domain's connections share with it: the arena, the address space
//! and the peer arenas mapped into it, the line to the broker, and the
//! options new channels start with.
//!
//! Both the domain (`domain.rs`) and its channels (`channel/`) use this; it
//! uses neither, so the channel never reaches back into the domain.

use crate::control::Control;
use crate::error::{Error, Result};
use crate::platform::Platform;
use fido_proto::{DomainId, Reply, Request};
use fido_ring::WaitStrategy;
use fido_shm::{AddressSpace, Arena, Mapping};
use parking_lot::Mutex;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

/// A peer arena mapped into our address space, and whether its owner died.
pub(crate) struct MappedPeer {
    pub(crate) owner: DomainId,
    pub(crate) dead: bool,
}

/// The parts of this domain its connections use.
pub(crate) struct LocalDomain {
    pub(crate) space: Arc<AddressSpace>,
    pub(crate) arena: Arc<Arena>,
    pub(crate) control: Arc<Control>,
    /// Descriptors per ring direction of new channels.
    pub(crate) ring_entries: u32,
    /// Wait strategy of new channels.
    pub(crate) wait: WaitStrategy,
    /// Peer arenas mapped, by slot.
    pub(crate) mapped: Mutex<HashMap<u32, MappedPeer>>,
    /// Domains this domain has heard are dead.
    dead: Mutex<HashSet<DomainId>>,
    /// Payload bytes this domain copied (zero on every zero-copy path).
    pub(crate) bytes_copied: AtomicU64,
    /// Host process or VM guest.
    pub(crate) platform: Platform,
}

impl LocalDomain {
    pub(crate) fn new(
        space: Arc<AddressSpace>,
        arena: Arc<Arena>,
        control: Arc<Control>,
        (ring_entries, wait): (u32, WaitStrategy),
        platform: Platform,
    ) -> LocalDomain {
        LocalDomain {
            space,
            arena,
            control,
            ring_entries,
            wait,
            mapped: Mutex::new(HashMap::new()),
            dead: Mutex::new(HashSet::new()),
            bytes_copied: AtomicU64::new(0),
            platform,
        }
    }

    /// Makes sure the arena in `slot` is mapped, asking the broker for a grant
    /// the first time a pointer into it shows up (a forwarded message).
    pub(crate) fn ensure_mapped(&self, slot: u32) -> Result<Arc<Mapping>> {
        if let Some(m) = self.space.mapping(slot) {
            return Ok(m);
        }
        let (reply, mut fds) = self.control.request(Request::GrantSlot { slot }, &[])?;
        match reply {
            Reply::Grant { owner, slot: s, arena_len } if s == slot && fds.len() == 1 => {
                let m = self.platform.map_peer(&self.space, slot, owner, fds.remove(0), arena_len)?;
                self.register_mapping(slot, owner);
                Ok(m)
            }
            other => Err(Error::broker_protocol(format!("bad grant reply {other:?} with {} fds", fds.len()))),
        }
    }

    pub(crate) fn register_mapping(&self, slot: u32, owner: DomainId) {
        let dead = self.dead.lock().contains(&owner);
        self.mapped.lock().insert(slot, MappedPeer { owner, dead });
    }

    /// Remembers that `domain` died, for its arenas mapped now and later (a
    /// grant of a dead domain's arena that a forwarded message still points
    /// into).
    pub(crate) fn note_dead(&self, domain: DomainId) {
        self.dead.lock().insert(domain);
        for m in self.mapped.lock().values_mut() {
            if m.owner == domain {
                m.dead = true;
            }
        }
    }

    /// Unmaps arenas of dead peers that nothing references any more, and tells
    /// the broker so it can reuse their slots.
    pub(crate) fn sweep_mappings(&self) {
        let mut mapped = self.mapped.lock();
        let done: Vec<(u32, DomainId)> = mapped
            .iter()
            .filter(|(slot, m)| m.dead && self.space.mapping(**slot).is_none_or(|a| Arc::strong_count(&a) <= 2))
            .map(|(s, m)| (*s, m.owner))
            .collect();
        for (slot, owner) in done {
            mapped.remove(&slot);
            self.space.unmap(slot);
            self.control.notify(Request::Unmapped { slot, owner });
        }
    }
}
