//! The channels of one domain: the live ones, by id (for the domain's
//! events and counters), those closed while the peer still holds messages
//! we sent, those that carried forwarded messages, and the forwarded
//! messages nobody will release.

use super::conn::ConnShared;
use super::message::Message;
use crate::local_domain::LocalDomain;
use fido_proto::{ConnId, Counters};
use fido_ring::doorbell;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::os::fd::AsFd;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};

/// Every channel of one domain, and the domain's resources they use.
pub(crate) struct Connections {
    pub(crate) local: Arc<LocalDomain>,
    /// Channels whose `Channel` is alive.
    pub(super) live: Mutex<HashMap<ConnId, Weak<ConnShared>>>,
    /// Closed channels whose sent messages the peer still holds.
    pub(super) lingering: Mutex<Vec<Lingering>>,
    /// Channels that carried forwarded messages (their releases must flow
    /// upstream even while this domain only receives).
    pub(super) forwarding: Mutex<Vec<Weak<ConnShared>>>,
    /// Forwarded messages (whole, or a shared forward's reference) whose
    /// downstream went away without releasing them: held (never released upstream) for the life of the domain.
    pub(super) orphaned: Mutex<Vec<Message>>,
    /// Counters of channels that are gone.
    pub(super) retired: Mutex<Counters>,
}

/// A closed channel whose sent buffers the peer may still be reading.
pub(super) struct Lingering {
    pub(super) shared: Arc<ConnShared>,
}

impl Connections {
    pub(crate) fn new(local: Arc<LocalDomain>) -> Connections {
        Connections {
            local,
            live: Mutex::new(HashMap::new()),
            lingering: Mutex::new(Vec::new()),
            forwarding: Mutex::new(Vec::new()),
            orphaned: Mutex::new(Vec::new()),
            retired: Mutex::new(Counters::default()),
        }
    }

    /// The channels alive now.
    pub(crate) fn live(&self) -> Vec<Arc<ConnShared>> {
        self.live.lock().values().filter_map(Weak::upgrade).collect()
    }

    /// The channel `conn`, if it is alive.
    pub(crate) fn get(&self, conn: ConnId) -> Option<Arc<ConnShared>> {
        self.live.lock().get(&conn).and_then(Weak::upgrade)
    }

    /// Counters of this domain's data path (all channels, past and present).
    pub(crate) fn counters(&self) -> Counters {
        let mut c = *self.retired.lock();
        for conn in self.live() {
            conn.add_counters(&mut c);
        }
        c.bytes_copied += self.local.bytes_copied.load(Ordering::Relaxed);
        c
    }

    /// Collects releases on every channel that forwarded messages; true while any
    /// forwarded message is still in flight. Channels whose sender currently holds
    /// the lock are skipped: that sender reaps them itself.
    pub(crate) fn reap_forwarded(&self) -> bool {
        let chans: Vec<Arc<ConnShared>> = {
            let mut list = self.forwarding.lock();
            list.retain(|w| w.strong_count() > 0);
            list.iter().filter_map(Weak::upgrade).collect()
        };
        let mut pending = false;
        for c in chans {
            if let Some(mut tx) = c.tx.try_lock() {
                if let Err(why) = tx.reap() {
                    c.mark_broken(why);
                    continue;
                }
                pending |= tx.ring.in_flight() > 0 && c.is_open();
            } else {
                pending = true;
            }
        }
        pending
    }

    /// Frees lingering channels whose peer released everything or is gone.
    pub(crate) fn sweep_lingering(&self) {
        let list = std::mem::take(&mut *self.lingering.lock());
        let mut keep = Vec::new();
        for l in list {
            let done = {
                let mut tx = l.shared.tx.lock();
                let reaped = tx.reap().is_ok();
                // Not `peer_closed`: a peer that closed may still hold our messages.
                let gone = doorbell::peer_hung_up(l.shared.liveness.as_fd());
                !reaped || gone || tx.ring.in_flight() == 0
            };
            if !done {
                keep.push(l);
            }
        }
        self.lingering.lock().extend(keep);
    }
}
