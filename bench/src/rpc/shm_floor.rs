//! `shm-floor`: the ceiling of any synchronous shared-memory RPC under the
//! suite's rules, measured as a system of its own on the sequence cases.
//!
//! The rules every system follows (see [`super::data`]): the sequence is built
//! fresh for every call with the same generators, the receiver folds every
//! element, the calls are synchronous. A shared-memory RPC cannot do less than
//! build + fold, so this system does only that plus the smallest possible
//! hand-off:
//!
//! * The server creates one memfd region (control page + data area sized for the
//!   point's sequence), touches every page, and hands the descriptor to the
//!   client over the point's Unix socket (`SCM_RIGHTS`); both map it
//!   `MAP_SHARED | MAP_POPULATE`. The region is reused by every call: no
//!   allocation, no page faults in the measured window.
//! * send: the client builds the sequence straight into the data area, stores the
//!   element count, then the call's seed in its control word (release); the server
//!   spins on that word (bounded spin, then `sched_yield`, as `spin-floor`),
//!   validates the count against the region, folds every element, stores the
//!   checksum, then the seed in its own word; the client spins on it and asserts
//!   the checksum against the one it computed while building.
//! * recv is the mirror: the server builds (with the requested count and seed),
//!   stores its checksum and the count; the client checks the count, folds every
//!   element and asserts.
//! * Layout = the `fido` system's (`fido-cli`'s `rpc_bench.rs`): ByteSeq the bytes,
//!   FixedSeq 16-byte `{i32 i; i32 j; f64 d}` records, VarSeq 24-byte
//!   `{f64 d; u64 off; u64 len}` records (fido's `FVar {d, ShmStr {addr, len}}`)
//!   whose 10-byte strings are stored out of line, packed after the record array
//!   (where fido's frame puts them). The receiver bounds-checks every string
//!   reference before reading it, as fido's `View::str` does.
//! * The server's checksum goes through [`data::server_sum`] (the
//!   `FIDO_BENCH_RPC_CORRUPT=1` test hook), like every other Rust server's.
//!
//! A dead peer is noticed through the socket (hang-up), looked at every 256
//! yields of a wait: the client fails, the server exits.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::{bail, ensure, Context as _};

use super::data::{self, Dir, Fixed, Seq, VAR_STR};
use super::{Case, RpcClient};

pub const NAME: &str = "shm-floor";

const PAGE: usize = 4096;
// Control page: the client's words on one cache line, the server's on another.
/// Client: seed of the current call (stored last, release).
const CALL: usize = 0;
/// Client: element count of the call (send: built; recv: requested).
const COUNT: usize = 8;
/// Server: seed of the call it finished (stored last, release).
const DONE: usize = 64;
/// Server: its checksum (send: of what it folded; recv: of what it built).
const SUM: usize = 72;
/// Server (recv): element count it built.
const BUILT: usize = 80;

/// A VarSeq element: fido's `FVar { d: f64, s: ShmStr { addr, len } }`, with the
/// string's offset in the data area instead of a global address.
#[repr(C)]
#[derive(Clone, Copy)]
struct VarElem {
    d: f64,
    off: u64,
    len: u64,
}

const VAR_ELEM: usize = std::mem::size_of::<VarElem>();

/// Data-area bytes a call of `seq` with `len` needs.
fn data_bytes(seq: Seq, len: usize) -> Option<usize> {
    match seq {
        Seq::Byte => len.checked_mul(10),
        Seq::Fixed => len.checked_mul(16),
        Seq::Var => len.checked_mul(VAR_ELEM + VAR_STR),
    }
}

/// A shared mapping of the point's memfd: control page, then the data area.
struct Shared {
    base: *mut u8,
    len: usize,
    _map: crate::shm::MemfdMapping,
}

impl Shared {
    fn map(fd: BorrowedFd<'_>, len: usize) -> anyhow::Result<Shared> {
        ensure!(len > PAGE, "shm-floor region of {len} bytes is too small");
        let map = crate::shm::MemfdMapping::new(fd, len)?;
        Ok(Shared { base: map.base(), len: map.len(), _map: map })
    }

    fn word(&self, at: usize) -> &AtomicU64 {
        debug_assert!(at.is_multiple_of(8) && at < PAGE);
        // SAFETY: 8-aligned, inside the control page, only ever accessed atomically by
        // both processes.
        unsafe { &*(self.base.add(at) as *const AtomicU64) }
    }

    fn capacity(&self) -> usize {
        self.len - PAGE
    }

    /// The data area (see `data_mut`).
    fn data(&self) -> &[u8] {
        // SAFETY: in bounds; see `data_mut`.
        unsafe { std::slice::from_raw_parts(self.base.add(PAGE), self.capacity()) }
    }

    /// The data area, writable. The protocol gives the side whose turn it is exclusive use of
    /// it: the client until it publishes `CALL`, the server until it publishes
    /// `DONE`; the other side does not touch it in between.
    #[allow(clippy::mut_from_ref)]
    fn data_mut(&self) -> &mut [u8] {
        // SAFETY: in bounds (the mapping is `len` bytes); exclusive per turn (above);
        // every caller holds the slice only within its turn.
        unsafe { std::slice::from_raw_parts_mut(self.base.add(PAGE), self.capacity()) }
    }
}


/// `&mut [T]` over the first `n` elements of `data` (the data area is
/// page-aligned).
fn typed_mut<T: Copy>(data: &mut [u8], n: usize) -> &mut [T] {
    assert!(n * std::mem::size_of::<T>() <= data.len());
    assert!((data.as_ptr() as usize).is_multiple_of(std::mem::align_of::<T>()));
    // SAFETY: in bounds and aligned (asserted); `T` is only ever `Fixed` or
    // `VarElem`, plain numbers for which every bit pattern is valid.
    unsafe { std::slice::from_raw_parts_mut(data.as_mut_ptr() as *mut T, n) }
}

/// `&[T]` over the first `n` elements of `data`.
fn typed<T: Copy>(data: &[u8], n: usize) -> &[T] {
    assert!(n * std::mem::size_of::<T>() <= data.len());
    assert!((data.as_ptr() as usize).is_multiple_of(std::mem::align_of::<T>()));
    // SAFETY: as in `typed_mut`.
    unsafe { std::slice::from_raw_parts(data.as_ptr() as *const T, n) }
}

/// Builds the sequence `(seq, n, seed)` into `data` with the suite's generators;
/// returns its checksum.
fn build(data: &mut [u8], seq: Seq, n: usize, seed: u64) -> u64 {
    match seq {
        Seq::Byte => data::fill_bytes(&mut data[..seq.elements(n)], seed),
        Seq::Fixed => {
            let mut s = 0u64;
            for (k, e) in typed_mut::<Fixed>(data, n).iter_mut().enumerate() {
                let f = data::fixed_at(seed, k);
                s = s.wrapping_add(data::fixed_sum(&f));
                *e = f;
            }
            s
        }
        Seq::Var => {
            let (elems, strs) = data.split_at_mut(n * VAR_ELEM);
            let mut s = 0u64;
            for (k, e) in typed_mut::<VarElem>(elems, n).iter_mut().enumerate() {
                let st = data::var_str_at(seed, k);
                let d = data::var_d_at(k);
                s = s.wrapping_add(data::var_sum(&st, d));
                strs[k * VAR_STR..(k + 1) * VAR_STR].copy_from_slice(&st);
                *e = VarElem {
                    d,
                    off: (n * VAR_ELEM + k * VAR_STR) as u64,
                    len: VAR_STR as u64,
                };
            }
            s
        }
    }
}

/// Folds every element of the `n`-element sequence in `data` (as the fido
/// system's receiver does); a string reference outside the data area fails.
fn fold(data: &[u8], seq: Seq, n: usize) -> anyhow::Result<u64> {
    Ok(match seq {
        Seq::Byte => data::sum_bytes(&data[..seq.elements(n)]),
        Seq::Fixed => data::sum_fixed(typed::<Fixed>(data, n)),
        Seq::Var => {
            let mut s = 0u64;
            for e in typed::<VarElem>(data, n) {
                let st = usize::try_from(e.off)
                    .ok()
                    .zip(usize::try_from(e.len).ok())
                    .and_then(|(o, l)| data.get(o..o.checked_add(l)?))
                    .with_context(|| {
                        format!(
                            "shm-floor: string [{}, +{}) outside the region",
                            e.off, e.len
                        )
                    })?;
                s = s.wrapping_add(data::var_sum(st, e.d));
            }
            s
        }
    })
}

/// Elements `n` of `seq` fit `shm`'s data area, or a clear error.
fn fits(shm: &Shared, seq: Seq, n: usize) -> anyhow::Result<()> {
    match data_bytes(seq, n) {
        Some(b) if b <= shm.capacity() => Ok(()),
        _ => bail!(
            "shm-floor: {} of {n} elements does not fit the {}-byte region",
            seq.name(),
            shm.capacity()
        ),
    }
}

/// Whether the peer at the other end of `sock` has gone (hang-up or EOF: nothing
/// is ever sent on it after the descriptor).
fn gone(sock: &UnixStream) -> bool {
    use rustix::event::{poll, PollFd, PollFlags, Timespec};
    let mut fds = [PollFd::new(sock, PollFlags::IN)];
    let now = Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    match poll(&mut fds, Some(&now)) {
        Ok(0) => false,
        Ok(_) => true,
        Err(rustix::io::Errno::INTR) => false,
        Err(_) => true,
    }
}

/// Waits until `ready(word)` (bounded spin, then `sched_yield`, as `spin-floor`
/// waits); returns the word, or `None` when the peer went away first.
fn wait_for(word: &AtomicU64, ready: impl Fn(u64) -> bool, peer: &UnixStream) -> Option<u64> {
    const SPINS: u32 = 1 << 14;
    for _ in 0..SPINS {
        let v = word.load(Ordering::Acquire);
        if ready(v) {
            return Some(v);
        }
        std::hint::spin_loop();
    }
    let mut n = 0u32;
    loop {
        let v = word.load(Ordering::Acquire);
        if ready(v) {
            return Some(v);
        }
        rustix::thread::sched_yield();
        n = n.wrapping_add(1);
        if n.is_multiple_of(256) && gone(peer) {
            return None;
        }
    }
}

fn send_fd(sock: &UnixStream, fd: BorrowedFd<'_>) -> anyhow::Result<()> {
    use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
    let fds = [fd];
    let mut space = [std::mem::MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    ensure!(
        control.push(SendAncillaryMessage::ScmRights(&fds)),
        "cmsg space"
    );
    let iov = [std::io::IoSlice::new(b"M")];
    rustix::net::sendmsg(sock, &iov, &mut control, SendFlags::NOSIGNAL)
        .context("sending the shm-floor region")?;
    Ok(())
}

fn recv_fd(sock: &UnixStream) -> anyhow::Result<OwnedFd> {
    use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags};
    let mut space = [std::mem::MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let mut b = [0u8; 1];
    let mut iov = [std::io::IoSliceMut::new(&mut b)];
    let m = rustix::net::recvmsg(sock, &mut iov, &mut control, RecvFlags::CMSG_CLOEXEC)
        .context("receiving the shm-floor region")?;
    let mut fd = None;
    for msg in control.drain() {
        if let RecvAncillaryMessage::ScmRights(rights) = msg {
            for r in rights {
                fd.get_or_insert(r);
            }
        }
    }
    match fd {
        Some(fd) if m.bytes == 1 && b == *b"M" => Ok(fd),
        _ => bail!("the shm-floor server sent no region"),
    }
}

/// The server process of one point: creates the region for `case`, hands it to
/// the one client, then answers calls until the client goes away.
pub fn serve(addr: &str, case: Case) -> anyhow::Result<()> {
    let Case::Seq { seq, dir, len } = case else {
        bail!(
            "shm-floor runs only the sequence cases, not {}",
            case.name()
        );
    };
    let bytes = data_bytes(seq, len).context("LEN too large")?;
    let size = PAGE + bytes.div_ceil(PAGE).max(1) * PAGE;
    let fd = rustix::fs::memfd_create("fido-bench-shm-floor", rustix::fs::MemfdFlags::CLOEXEC)?;
    rustix::fs::ftruncate(&fd, size as u64)?;
    let shm = Shared::map(fd.as_fd(), size)?;
    // Touch every page (MAP_POPULATE maps shared pages read-faulted): nobody pays a
    // fault in the measured window.
    shm.data_mut().fill(0);
    let listener = UnixListener::bind(addr).with_context(|| format!("binding {addr}"))?;
    super::emit_ready()?;
    let (sock, _) = listener.accept().context("accepting the client")?;
    send_fd(&sock, fd.as_fd())?;
    let (call, count, done, sum, built) = (
        shm.word(CALL),
        shm.word(COUNT),
        shm.word(DONE),
        shm.word(SUM),
        shm.word(BUILT),
    );
    let mut last = 0u64;
    loop {
        let Some(seed) = wait_for(call, |v| v != last, &sock) else {
            return Ok(()); // the client is done (or dead): so is the point
        };
        last = seed;
        let n = usize::try_from(count.load(Ordering::Relaxed)).unwrap_or(usize::MAX);
        fits(&shm, seq, n)?;
        let s = match dir {
            Dir::Send => fold(shm.data(), seq, n)?,
            Dir::Recv => {
                let s = build(shm.data_mut(), seq, n, seed);
                built.store(n as u64, Ordering::Relaxed);
                s
            }
        };
        sum.store(data::server_sum(s), Ordering::Relaxed);
        done.store(seed, Ordering::Release);
    }
}

/// The client side of one point.
pub struct Client {
    sock: UnixStream,
    shm: Shared,
}

impl Client {
    pub fn connect(addr: &str) -> anyhow::Result<Client> {
        let sock = UnixStream::connect(addr).with_context(|| format!("connecting {addr}"))?;
        let fd = recv_fd(&sock)?;
        let size = usize::try_from(rustix::fs::fstat(&fd)?.st_size).context("region size")?;
        let shm = Shared::map(fd.as_fd(), size)?;
        Ok(Client { sock, shm })
    }

    /// Publishes the call and waits for the server's answer: its checksum.
    fn round_trip(&self, n: usize, seed: u64) -> anyhow::Result<u64> {
        self.shm.word(COUNT).store(n as u64, Ordering::Relaxed);
        self.shm.word(CALL).store(seed, Ordering::Release);
        if wait_for(self.shm.word(DONE), |v| v == seed, &self.sock).is_none() {
            bail!("the shm-floor server hung up");
        }
        // Published before `DONE` (release), read after it (acquire).
        Ok(self.shm.word(SUM).load(Ordering::Relaxed))
    }
}

impl RpcClient for Client {
    fn null(&mut self) -> anyhow::Result<()> {
        bail!("shm-floor runs only the sequence cases (the null floors are spin-floor, futex-floor and eventfd-floor)")
    }

    fn call(&mut self, seq: Seq, dir: Dir, len: usize, seed: u64) -> anyhow::Result<()> {
        fits(&self.shm, seq, len)?;
        match dir {
            Dir::Send => {
                let want = build(self.shm.data_mut(), seq, len, seed);
                let got = self.round_trip(len, seed)?;
                data::check("shm-floor send", got, want)
            }
            Dir::Recv => {
                let want = self.round_trip(len, seed)?;
                let n = self.shm.word(BUILT).load(Ordering::Relaxed);
                ensure!(
                    n == len as u64,
                    "shm-floor server built {n} elements, asked {len}"
                );
                let got = fold(self.shm.data(), seq, len)?;
                data::check("shm-floor recv", got, want)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn built_sequences_fold_to_the_expected_sums() {
        for seq in Seq::ALL {
            for n in [0usize, 1, 7, 1000] {
                let mut buf = vec![0u64; data_bytes(seq, n).unwrap().div_ceil(8)];
                // SAFETY: reinterpreting an owned, 8-aligned u64 buffer as bytes.
                let bytes = unsafe {
                    std::slice::from_raw_parts_mut(buf.as_mut_ptr() as *mut u8, buf.len() * 8)
                };
                let s = build(bytes, seq, n, 5);
                assert_eq!(s, data::expected(seq, n, 5), "{} {n}", seq.name());
                assert_eq!(fold(bytes, seq, n).unwrap(), s);
            }
        }
    }

    #[test]
    fn a_string_outside_the_region_is_refused() {
        let mut buf = vec![0u64; 64];
        // SAFETY: as above.
        let bytes =
            unsafe { std::slice::from_raw_parts_mut(buf.as_mut_ptr() as *mut u8, buf.len() * 8) };
        build(bytes, Seq::Var, 2, 1);
        typed_mut::<VarElem>(bytes, 2)[1].off = u64::MAX - 3;
        assert!(fold(bytes, Seq::Var, 2).is_err());
        typed_mut::<VarElem>(bytes, 2)[1].off = 512 - 5;
        assert!(fold(bytes, Seq::Var, 2).is_err());
    }
}
