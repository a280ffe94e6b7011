//! Ring tokens: the descriptor a peer's doorbell becomes inside a guest.
//!
//! The `fido` library keeps a peer's ring end as a descriptor until it builds
//! the connection; in a guest there is no descriptor to give, so the link
//! transport makes a small sealed memfd holding a key, the ivshmem peer id and
//! the vector, and [`crate::Guest::ring_end`] reads it back into a register
//! ring. Only this crate makes and reads them; the key (random per process)
//! makes a memfd that merely looks like one useless.

use std::os::fd::{AsFd, OwnedFd};

/// Token contents: key (8 bytes), peer (2), vector (2), all little-endian.
const TOKEN_LEN: usize = 12;

/// Makes a token for ringing `vector` of ivshmem peer `peer`.
pub(crate) fn make(key: u64, peer: u16, vector: u16) -> std::io::Result<OwnedFd> {
    use rustix::fs::{MemfdFlags, SealFlags};
    let fd = rustix::fs::memfd_create(
        "fido-guest-ring",
        MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
    )?;
    let mut bytes = [0u8; TOKEN_LEN];
    bytes[..8].copy_from_slice(&key.to_le_bytes());
    bytes[8..10].copy_from_slice(&peer.to_le_bytes());
    bytes[10..12].copy_from_slice(&vector.to_le_bytes());
    if rustix::io::write(&fd, &bytes)? != TOKEN_LEN {
        return Err(std::io::Error::other("short write of a ring token"));
    }
    rustix::fs::fcntl_add_seals(
        &fd,
        SealFlags::WRITE | SealFlags::GROW | SealFlags::SHRINK | SealFlags::SEAL,
    )?;
    Ok(fd)
}

/// Reads a token back: `(peer, vector)`, or `None` when `fd` is not a sealed
/// token made with `key`.
pub(crate) fn read(key: u64, fd: impl AsFd) -> Option<(u16, u16)> {
    use rustix::fs::SealFlags;
    let seals = rustix::fs::fcntl_get_seals(&fd).ok()?;
    if !seals.contains(SealFlags::WRITE | SealFlags::SHRINK | SealFlags::GROW) {
        return None;
    }
    let mut bytes = [0u8; TOKEN_LEN + 1];
    let n = rustix::io::pread(&fd, &mut bytes, 0).ok()?;
    if n != TOKEN_LEN || bytes[..8] != key.to_le_bytes() {
        return None;
    }
    Some((
        u16::from_le_bytes([bytes[8], bytes[9]]),
        u16::from_le_bytes([bytes[10], bytes[11]]),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_round_trip_and_strangers_are_refused() {
        let t = make(0x1234_5678_9abc_def0, 7, 3).unwrap();
        assert_eq!(read(0x1234_5678_9abc_def0, &t), Some((7, 3)));
        assert_eq!(read(1, &t), None, "another key");
        let unsealed = rustix::fs::memfd_create("x", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        rustix::io::write(&unsealed, &0x1234_5678_9abc_def0u64.to_le_bytes()).unwrap();
        rustix::io::write(&unsealed, &[7, 0, 3, 0]).unwrap();
        assert_eq!(read(0x1234_5678_9abc_def0, &unsealed), None, "unsealed");
        let (a, _b) = rustix::net::socketpair(
            rustix::net::AddressFamily::UNIX,
            rustix::net::SocketType::STREAM,
            rustix::net::SocketFlags::CLOEXEC,
            None,
        )
        .unwrap();
        assert_eq!(read(0x1234_5678_9abc_def0, &a), None, "a socket");
    }
}
