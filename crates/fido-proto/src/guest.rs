//! The guest link: how a domain inside a VM reaches the broker through its
//! VM's supervisor.
//!
//! A guest cannot pass file descriptors, so it cannot speak the broker
//! protocol directly. It speaks it *through* the link: every control frame
//! (an encoded [`crate::ClientMsg`] or [`crate::BrokerMsg`], exactly what would
//! cross the broker's socket) travels inside a [`GuestMsg::Frame`] or
//! [`HostMsg::Frame`], and each descriptor that would have travelled beside it
//! is replaced by a **handle** naming a device the guest can open itself:
//!
//! | descriptor on the host              | handle in the guest                                    |
//! |-------------------------------------|--------------------------------------------------------|
//! | a peer's arena (sealed memfd, ro)    | [`Handle::Arena`]: an `ivshmem-plain` device the supervisor hot-plugged read-only under a PCIe root port |
//! | a peer's doorbell ring end           | [`Handle::Ring`]: an ivshmem peer id of the doorbell device (ring = write `(peer << 16) \| 0` to BAR0 + 12) |
//! | a liveness socket                    | [`Handle::Liveness`]: a token; [`HostMsg::Hangup`] says the peer is gone |
//! | our own doorbell ring ends (sent)    | `bells` in [`GuestMsg::Frame`]: MSI-X vectors of our doorbell device |
//! | our own arena (sent at `Join`)        | nothing: the supervisor attaches the arena it gave the VM |
//!
//! The link is a byte stream (a virtio-serial port named [`PORT_NAME`]); each
//! message is a little-endian `u32` length followed by that many bytes of
//! `postcard`. Both sides treat the other as hostile: [`decode_guest`] and
//! [`decode_host`] accept any bytes and return a checked message or an error,
//! and a length over [`MAX_LINK_MESSAGE`] ends the link.

use crate::{ProtoError, MAX_MESSAGE};
use serde::{Deserialize, Serialize};

/// Name of the virtio-serial port that carries the link (`/sys/class/virtio-ports/*/name`).
pub const PORT_NAME: &str = "org.fido.broker";
/// Version of the link protocol (independent of the broker protocol's).
pub const LINK_VERSION: u32 = 1;
/// Largest link message body: a broker frame plus its handles.
pub const MAX_LINK_MESSAGE: usize = MAX_MESSAGE + 4096;
/// Most handles or bells beside one frame (as many as descriptors).
pub const MAX_HANDLES: usize = crate::MAX_FDS;
/// Longest PCI address string ("0000:00:04.0" is 12).
const MAX_PCI_ADDR: usize = 32;
/// Most hot-plug ports a VM may be given.
pub const MAX_PORTS: usize = 256;

/// What the guest sends to its supervisor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum GuestMsg {
    /// First message on a fresh link (and after the guest reopens the port).
    /// The supervisor answers with [`HostMsg::Welcome`].
    Hello { version: u32 },
    /// One control frame for the broker. `bells` stands for the descriptors the
    /// request carries, in order: each is one of our doorbell device's MSI-X
    /// vectors (a `Connect` or `Accept` carries two: data bell, space bell).
    Frame { frame: Vec<u8>, bells: Vec<u16> },
    /// The guest lost its broker session and wants a fresh connection to the
    /// broker (after a broker restart); answered with [`HostMsg::Reconnected`]
    /// or [`HostMsg::BrokerDown`].
    Reconnect,
}

/// What the supervisor sends to the guest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum HostMsg {
    /// Answer to [`GuestMsg::Hello`]: where the VM's devices are.
    Welcome(Welcome),
    /// One control frame from the broker, with a handle for each descriptor
    /// that came with it, in order.
    Frame { frame: Vec<u8>, handles: Vec<Handle> },
    /// The peer behind [`Handle::Liveness`] `token` is gone (its liveness
    /// socket hung up): what the socket's EOF means on the host.
    Hangup { token: u64 },
    /// The broker connection ended (the broker died or restarted): the guest's
    /// session fails what is pending and asks to [`GuestMsg::Reconnect`].
    BrokerClosed,
    /// A fresh broker connection is up; the guest re-registers on it.
    Reconnected,
    /// No broker is reachable now; the guest retries later.
    BrokerDown { reason: String },
    /// The supervisor refused a guest message (bad frame, bad bell, quota);
    /// the link stays up. `id` is the request's id when it could be read.
    Refused { id: Option<u64>, reason: String },
}

/// Where the VM's Fido devices are, as PCI addresses in the guest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Welcome {
    pub version: u32,
    /// The VM's own arena: an `ivshmem-plain` device (BAR 2), read-write.
    pub arena: String,
    /// Its length in bytes (the BAR size; a power of two).
    pub arena_len: u64,
    /// The `ivshmem-doorbell` device (BAR 0 registers, MSI-X vectors).
    pub doorbell: String,
    /// How many MSI-X vectors it has; vector 0 is reserved.
    pub vectors: u16,
    /// Our own ivshmem peer id (what a peer writes to ring us; informative).
    pub own_peer: u16,
    /// The PCIe root ports that hot-plugged peer arenas appear under, by index
    /// ([`Handle::Arena::port`]); each holds at most one device, at function 0
    /// of its secondary bus.
    pub ports: Vec<String>,
    /// Largest peer arena a port can hold (its prefetchable window).
    pub max_peer_arena: u64,
}

/// What a descriptor became on its way into the guest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Handle {
    /// A peer's arena, hot-plugged read-only as the device under root port
    /// `port` (an index into [`Welcome::ports`]); `len` is its BAR size.
    Arena { port: u16, len: u64 },
    /// A peer's doorbell: ring it by writing `(peer << 16) | vector` to the
    /// doorbell device's BAR0 + 12.
    Ring { peer: u16, vector: u16 },
    /// A liveness socket: the supervisor sends [`HostMsg::Hangup`] with this
    /// token when it hangs up.
    Liveness { token: u64 },
    /// A descriptor the guest cannot use (a socket or file in a reply the
    /// guest should not have asked for); the guest treats the reply as failed.
    Unsupported,
}

impl Welcome {
    fn check(&self) -> Result<(), ProtoError> {
        let addr_ok = |a: &str| !a.is_empty() && a.len() <= MAX_PCI_ADDR && a.bytes().all(|b| b.is_ascii_hexdigit() || b == b':' || b == b'.');
        if !addr_ok(&self.arena) || !addr_ok(&self.doorbell) || !self.ports.iter().all(|p| addr_ok(p)) {
            return Err(ProtoError::Invalid("PCI address"));
        }
        if self.ports.len() > MAX_PORTS {
            return Err(ProtoError::Invalid("too many ports"));
        }
        if !self.arena_len.is_power_of_two() || self.vectors < 2 || !self.max_peer_arena.is_power_of_two() {
            return Err(ProtoError::Invalid("welcome sizes"));
        }
        Ok(())
    }
}

/// Encodes a link message with its length prefix.
pub fn encode_link<T: Serialize>(msg: &T) -> Result<Vec<u8>, ProtoError> {
    let body = postcard::to_stdvec(msg).map_err(|_| ProtoError::Invalid("encode"))?;
    if body.len() > MAX_LINK_MESSAGE {
        return Err(ProtoError::Invalid("link message too large"));
    }
    let mut out = Vec::with_capacity(4 + body.len());
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(&body);
    Ok(out)
}

/// The body length a link message's 4-byte prefix announces, or an error
/// when it is over [`MAX_LINK_MESSAGE`] (the link must then be closed: the
/// stream cannot be resynchronised).
pub fn link_len(prefix: [u8; 4]) -> Result<usize, ProtoError> {
    let n = u32::from_le_bytes(prefix) as usize;
    if n == 0 || n > MAX_LINK_MESSAGE {
        return Err(ProtoError::Invalid("link message length"));
    }
    Ok(n)
}

/// Decodes and checks a message body from the guest (hostile input).
pub fn decode_guest(body: &[u8]) -> Result<GuestMsg, ProtoError> {
    let (msg, rest): (GuestMsg, &[u8]) = postcard::take_from_bytes(body).map_err(|_| ProtoError::Invalid("guest message"))?;
    if !rest.is_empty() {
        return Err(ProtoError::Invalid("trailing bytes"));
    }
    if let GuestMsg::Frame { frame, bells } = &msg {
        if frame.len() > MAX_MESSAGE || bells.len() > MAX_HANDLES {
            return Err(ProtoError::Invalid("guest frame"));
        }
    }
    Ok(msg)
}

/// Decodes and checks a message body from the supervisor.
pub fn decode_host(body: &[u8]) -> Result<HostMsg, ProtoError> {
    let (msg, rest): (HostMsg, &[u8]) = postcard::take_from_bytes(body).map_err(|_| ProtoError::Invalid("host message"))?;
    if !rest.is_empty() {
        return Err(ProtoError::Invalid("trailing bytes"));
    }
    match &msg {
        HostMsg::Welcome(w) => w.check()?,
        HostMsg::Frame { frame, handles } if frame.len() > MAX_MESSAGE || handles.len() > MAX_HANDLES => {
            return Err(ProtoError::Invalid("host frame"));
        }
        HostMsg::BrokerDown { reason } | HostMsg::Refused { reason, .. } if reason.len() > crate::MAX_PATH => {
            return Err(ProtoError::Invalid("reason too long"));
        }
        _ => {}
    }
    Ok(msg)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roundtrip_host(m: HostMsg) {
        let bytes = encode_link(&m).unwrap();
        let n = link_len(bytes[..4].try_into().unwrap()).unwrap();
        assert_eq!(n, bytes.len() - 4);
        assert_eq!(decode_host(&bytes[4..]).unwrap(), m);
    }

    #[test]
    fn messages_roundtrip() {
        roundtrip_host(HostMsg::Welcome(Welcome {
            version: LINK_VERSION,
            arena: "0000:00:04.0".into(),
            arena_len: 64 << 20,
            doorbell: "0000:00:05.0".into(),
            vectors: 64,
            own_peer: 0,
            ports: vec!["0000:00:10.0".into()],
            max_peer_arena: 1 << 30,
        }));
        roundtrip_host(HostMsg::Frame { frame: vec![1, 2, 3], handles: vec![Handle::Arena { port: 1, len: 4096 }, Handle::Ring { peer: 7, vector: 0 }, Handle::Liveness { token: 9 }] });
        let g = GuestMsg::Frame { frame: vec![9; 100], bells: vec![2, 3] };
        let bytes = encode_link(&g).unwrap();
        assert_eq!(decode_guest(&bytes[4..]).unwrap(), g);
    }

    #[test]
    fn hostile_input_is_refused() {
        assert!(link_len((MAX_LINK_MESSAGE as u32 + 1).to_le_bytes()).is_err());
        assert!(link_len(0u32.to_le_bytes()).is_err());
        let g = GuestMsg::Frame { frame: vec![], bells: vec![1; MAX_HANDLES + 1] };
        assert!(decode_guest(&encode_link(&g).unwrap()[4..]).is_err());
        let bad = HostMsg::Welcome(Welcome {
            version: 1,
            arena: "../../etc".into(),
            arena_len: 3,
            doorbell: String::new(),
            vectors: 0,
            own_peer: 0,
            ports: vec![],
            max_peer_arena: 0,
        });
        assert!(decode_host(&encode_link(&bad).unwrap()[4..]).is_err());
        for junk in [&[][..], &[0xff; 3], &[7, 0, 0, 0, 0, 0, 0, 0, 0]] {
            assert!(decode_guest(junk).is_err());
            assert!(decode_host(junk).is_err());
        }
        let mut ok = encode_link(&GuestMsg::Reconnect).unwrap();
        ok.push(0);
        assert!(decode_guest(&ok[4..]).is_err(), "trailing bytes");
    }
}
