//! Hot-plugging a peer's arena into a running VM, read-only.
//!
//! Each peer arena is an `ivshmem-plain` device on its own PCIe root port
//! (`fido-port{i}`, made by [`crate::qemu`] with a prefetchable window of
//! `max_peer_arena` bytes). The sequence, over QMP:
//!
//! 1. `add-fd` with the arena's read-only descriptor (SCM_RIGHTS): QEMU
//!    answers the number it holds it under;
//! 2. `object-add memory-backend-file` `fido-peer{i}` with
//!    `mem-path=/proc/self/fd/<that number>`, `share=on`, `readonly=on`:
//!    QEMU opens the memfd again read-only and maps it `PROT_READ`, so guest
//!    writes to the BAR are dropped;
//! 3. `device_add ivshmem-plain` `fido-dev{i}` on bus `fido-port{i}`: the
//!    guest sees it through ACPI hot-plug;
//! 4. `remove-fd`: QEMU keeps no descriptor beside its mapping.
//!
//! Unplug is `device_del`, the guest's `DEVICE_DELETED`, then `object-del`
//! (QEMU unmaps). The guest must have been told first: a guest still mapping
//! the BAR reads zeros afterwards, which Fido's revocation protocol announces.

use crate::qmp::{Qmp, QmpError};
use serde_json::{json, Value};
use std::os::fd::{AsFd, BorrowedFd};
use std::time::Duration;

/// What went wrong plugging or unplugging.
#[derive(Debug, thiserror::Error)]
pub enum HotplugError {
    #[error(transparent)]
    Qmp(#[from] QmpError),
    #[error("peer arena of {len} bytes: {why}")]
    BadLength { len: u64, why: String },
    #[error("peer arena descriptor: {0}")]
    BadFd(String),
    #[error("port {port} does not exist (the VM has {count})")]
    NoSuchPort { port: u16, count: u16 },
    #[error("every hot-plug port is in use")]
    NoFreePort,
    #[error("port {port} is in use")]
    PortInUse { port: u16 },
    #[error("unplug of port {port}: the guest did not release the device within {timeout:?}")]
    UnplugTimeout { port: u16, timeout: Duration },
}

/// QEMU id of root port `port`.
pub fn port_id(port: u16) -> String {
    format!("fido-port{port}")
}

/// QEMU id of the device plugged into `port`.
pub fn device_id(port: u16) -> String {
    format!("fido-dev{port}")
}

/// QEMU id of the memory backend of the device in `port`.
pub fn object_id(port: u16) -> String {
    format!("fido-peer{port}")
}

/// Checks a peer arena length: a power of two (else QEMU aborts on the BAR),
/// at least a page, at most the ports' window.
pub fn check_peer_len(len: u64, max_peer_arena: u64) -> Result<(), HotplugError> {
    if !len.is_power_of_two() || len < 4096 {
        return Err(HotplugError::BadLength { len, why: "not a power of two of at least 4 KiB".into() });
    }
    if len > max_peer_arena {
        return Err(HotplugError::BadLength { len, why: format!("larger than a port's window ({max_peer_arena} bytes)") });
    }
    Ok(())
}

/// Plugs the arena behind `ro_fd` (`len` bytes) into root port `port`, read-only.
///
/// `ro_fd` must be a grant as the broker hands them out
/// ([`fido_shm::check_grant`]: sealed, open read-only, at least `len` bytes),
/// so the guest never gets a writable mapping of another domain's arena and
/// the owner cannot pull the pages from under QEMU. On any failure what was
/// done is undone, so the port is free again.
pub fn plug_arena(qmp: &mut Qmp, port: u16, ro_fd: BorrowedFd<'_>, len: u64, max_peer_arena: u64) -> Result<(), HotplugError> {
    check_peer_len(len, max_peer_arena)?;
    // The grant checks every receiver makes: sealed against shrinking (a
    // truncated file would SIGBUS QEMU when the guest reads), growing and new
    // writable mappings; the description read-only; the file long enough.
    fido_shm::check_grant(ro_fd, len).map_err(|e| HotplugError::BadFd(e.to_string()))?;
    let added = qmp.execute_with_fd("add-fd", Value::Null, ro_fd.as_fd())?;
    let (fdset, qemu_fd) = match (added.get("fdset-id").and_then(Value::as_u64), added.get("fd").and_then(Value::as_u64)) {
        (Some(s), Some(f)) if f <= i32::MAX as u64 => (s, f),
        _ => return Err(QmpError::Garbled(format!("add-fd returned {added}")).into()),
    };
    let remove_fd = |qmp: &mut Qmp| qmp.execute("remove-fd", json!({ "fdset-id": fdset }));
    let object = json!({
        "qom-type": "memory-backend-file",
        "id": object_id(port),
        "mem-path": format!("/proc/self/fd/{qemu_fd}"),
        "size": len,
        "share": true,
        "readonly": true,
    });
    if let Err(e) = qmp.execute("object-add", object) {
        let _ = remove_fd(qmp);
        return Err(e.into());
    }
    let device = json!({ "driver": "ivshmem-plain", "id": device_id(port), "memdev": object_id(port), "bus": port_id(port) });
    if let Err(e) = qmp.execute("device_add", device) {
        let _ = qmp.execute("object-del", json!({ "id": object_id(port) }));
        let _ = remove_fd(qmp);
        return Err(e.into());
    }
    // QEMU mapped the arena through its own open of the path; the fdset's
    // copy is closed (at once while the VM runs, else when it starts).
    remove_fd(qmp)?;
    Ok(())
}

/// Unplugs the device in `port` and frees its memory backend. Waits up to
/// `timeout` for the guest to release the device (ACPI eject); on timeout
/// the device stays and the error says so (the supervisor may retry or stop
/// the VM). A port with no device is not an error (idempotent after a
/// half-done unplug).
pub fn unplug(qmp: &mut Qmp, port: u16, timeout: Duration) -> Result<(), HotplugError> {
    let id = device_id(port);
    match qmp.execute("device_del", json!({ "id": id })) {
        Ok(_) => {
            let is_ours = |d: &Value| d.get("device").and_then(Value::as_str) == Some(id.as_str());
            match qmp.take_event_matching("DEVICE_DELETED", timeout, is_ours) {
                Ok(_) => {}
                Err(QmpError::Timeout { .. }) => return Err(HotplugError::UnplugTimeout { port, timeout }),
                Err(e) => return Err(e.into()),
            }
        }
        // Already gone (a previous unplug finished after its timeout).
        Err(QmpError::Command { class, .. }) if class == "DeviceNotFound" => {}
        Err(e) => return Err(e.into()),
    }
    match qmp.execute("object-del", json!({ "id": object_id(port) })) {
        Ok(_) => Ok(()),
        Err(QmpError::Command { desc, .. }) if desc.contains("not found") => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// The peer arena a port holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerArena {
    /// Its PGVAS slot (where the guest maps it).
    pub slot: u32,
    /// The domain that owns it.
    pub owner: u64,
    pub len: u64,
}

/// Which hot-plug port holds which peer arena.
#[derive(Debug, Clone)]
pub struct Ports {
    max_peer_arena: u64,
    used: Vec<Option<PeerArena>>,
    /// Where the next allocation starts looking.
    next: usize,
}

impl Ports {
    /// `count` ports of `max_peer_arena` bytes each, all free.
    pub fn new(count: u16, max_peer_arena: u64) -> Ports {
        Ports { max_peer_arena, used: vec![None; count as usize], next: 0 }
    }

    pub fn count(&self) -> u16 {
        self.used.len() as u16
    }

    pub fn max_peer_arena(&self) -> u64 {
        self.max_peer_arena
    }

    /// Takes the lowest free port for `arena` (checking its length).
    pub fn allocate(&mut self, arena: PeerArena) -> Result<u16, HotplugError> {
        check_peer_len(arena.len, self.max_peer_arena)?;
        // Round robin from the port after the last one handed out: a port
        // just unplugged is taken again last (QEMU 7.2 was seen to exit when
        // a port was plugged again 10 ms after its unplug; cause not found).
        let n = self.used.len();
        let port = (0..n).map(|i| (self.next + i) % n).find(|&p| self.used[p].is_none()).ok_or(HotplugError::NoFreePort)?;
        self.used[port] = Some(arena);
        self.next = (port + 1) % n.max(1);
        Ok(port as u16)
    }

    /// Marks `port` as holding `arena` (e.g. after a supervisor restart).
    pub fn claim(&mut self, port: u16, arena: PeerArena) -> Result<(), HotplugError> {
        check_peer_len(arena.len, self.max_peer_arena)?;
        let count = self.count();
        let entry = self.used.get_mut(port as usize).ok_or(HotplugError::NoSuchPort { port, count })?;
        if entry.is_some() {
            return Err(HotplugError::PortInUse { port });
        }
        *entry = Some(arena);
        Ok(())
    }

    /// Frees `port`, returning what it held.
    pub fn release(&mut self, port: u16) -> Option<PeerArena> {
        self.used.get_mut(port as usize)?.take()
    }

    pub fn get(&self, port: u16) -> Option<&PeerArena> {
        self.used.get(port as usize)?.as_ref()
    }

    /// The port holding `owner`'s arena in `slot`.
    pub fn find(&self, slot: u32, owner: u64) -> Option<u16> {
        self.used.iter().position(|u| matches!(u, Some(a) if a.slot == slot && a.owner == owner)).map(|p| p as u16)
    }

    /// The used ports and what they hold.
    pub fn used(&self) -> impl Iterator<Item = (u16, &PeerArena)> {
        self.used.iter().enumerate().filter_map(|(i, u)| u.as_ref().map(|a| (i as u16, a)))
    }

    pub fn free_count(&self) -> usize {
        self.used.iter().filter(|u| u.is_none()).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_allocate_and_release() {
        let mut p = Ports::new(2, 1 << 20);
        let a = PeerArena { slot: 3, owner: 7, len: 1 << 20 };
        assert!(matches!(p.allocate(PeerArena { len: 3 << 20, ..a }), Err(HotplugError::BadLength { .. })));
        assert!(matches!(p.allocate(PeerArena { len: 2 << 20, ..a }), Err(HotplugError::BadLength { .. })));
        assert_eq!(p.allocate(a).unwrap(), 0);
        assert_eq!(p.allocate(PeerArena { slot: 4, ..a }).unwrap(), 1);
        assert!(matches!(p.allocate(a), Err(HotplugError::NoFreePort)));
        assert_eq!(p.find(4, 7), Some(1));
        assert_eq!(p.release(0), Some(a));
        assert_eq!(p.free_count(), 1);
        assert!(matches!(p.claim(1, a), Err(HotplugError::PortInUse { port: 1 })));
        assert!(matches!(p.claim(9, a), Err(HotplugError::NoSuchPort { .. })));
        assert_eq!(p.allocate(a).unwrap(), 0);
        assert_eq!(p.used().count(), 2);
    }
}
