//! Where ring state lives: one **block** per side of a connection, inside that
//! side's own arena. The owner writes it; the peer maps it read-only and reads it.
//!
//! ```text
//! line 0  magic
//! line 1  entries, flags (u64 at byte 8: FLAG_OTHER_KERNEL)
//! line 2  data_prod   (descriptors I published)  + data_bell  (u32 at byte 8)
//! line 3  data_cons   (peer descriptors I consumed)
//! line 4  data_sleep  (I sleep waiting for descriptors)
//! line 5  rel_prod    (releases I published)     + space_bell (u32 at byte 8)
//! line 6  rel_cons    (peer releases I reaped)
//! line 7  space_sleep (I sleep waiting for releases)
//! line 8  state       (OPEN / CLOSED by me)
//! then    descriptors[entries], releases[entries] (u64 cookies)
//! ```
//!
//! A descriptor slot carries its own publication mark (`seq`, the lap the
//! slot was last written for, [`lap_mark`]), stored last: a consumer waits on
//! the slot itself instead of reading the publish index and then the slot
//! (~40 ns of a polled RPC round trip whose messages are descriptors only;
//! docs/BENCHMARKS.md). The publish index is still kept: it is what the
//! sleep protocol and a consumer's sanity check read.
//!
//! Every word sits on its own cache line so the two sides never false-share,
//! except the bells: a bell (a `u32` futex word at byte 8 of its index's line)
//! is written by the same side as the index beside it, and a futex sleeper
//! reads both, so sharing the line saves it a cache miss.
//!
//! This module is the only one in the crate with `unsafe`: it turns the raw
//! addresses the caller vouches for into typed, bounds-checked accessors.

use crate::desc::{Descriptor, SEQ_OFFSET};
use crate::protocol;
use crate::sync::{AtomicU16, AtomicU32, AtomicU64, Ordering};
use std::ptr::NonNull;

/// Identifies an initialised block ("FIDORNG3": version 2 added the futex
/// bells and the two-bit sleep state, version 3 the slots' publication marks;
/// an older peer is refused: a version-2 consumer would not see a version-3
/// producer's marks as anything, and a version-2 producer never writes them).
pub const BLOCK_MAGIC: u64 = u64::from_le_bytes(*b"FIDORNG3");
/// Block flag: the owner runs under another kernel than its peer may (a VM
/// guest): a futex on its words cannot wake it or be woken by it, so neither
/// side sleeps on one; both sleep on their doorbells.
pub const FLAG_OTHER_KERNEL: u64 = 1;

/// `state` value while the owner keeps the connection open.
pub const STATE_OPEN: u64 = 1;
/// `state` value once the owner closed the connection gracefully.
pub const STATE_CLOSED: u64 = 2;

#[repr(C, align(64))]
struct Line(AtomicU64);

/// A publish index and the bell its writer bumps to wake a futex sleeper.
#[repr(C, align(64))]
struct ProdLine {
    index: AtomicU64,
    bell: AtomicU32,
}

/// The ring size and the owner's flags.
#[repr(C, align(64))]
struct EntriesLine {
    entries: AtomicU64,
    flags: AtomicU64,
}

#[repr(C)]
struct Header {
    magic: Line,
    entries: EntriesLine,
    data_prod: ProdLine,
    data_cons: Line,
    data_sleep: Line,
    rel_prod: ProdLine,
    rel_cons: Line,
    space_sleep: Line,
    state: Line,
}

const HEADER_LEN: usize = std::mem::size_of::<Header>();

/// The descriptor word (of eight) that holds the publication mark: opcode,
/// flags, nseg, then `seq` in its last two bytes.
const SEQ_WORD: usize = SEQ_OFFSET / 8;
const _: () = assert!(SEQ_OFFSET == SEQ_WORD * 8 + 6);
const _: () = assert!(HEADER_LEN == 9 * 64);

/// The publication mark of ring index `index` in a ring of `entries` slots:
/// the lap number plus one (so a zeroed slot does not carry the first lap's
/// mark). Slot
/// `index % entries` holds either the descriptor of `index` or that of
/// `index - entries` (a producer is never a lap ahead of its releases), whose
/// marks differ by one even where the `u16` wraps.
#[inline]
pub fn lap_mark(index: u64, entries: u32) -> u16 {
    ((index >> entries.trailing_zeros()) as u16).wrapping_add(1)
}

/// Bytes a block with `entries` ring entries occupies (a multiple of 64).
pub fn block_len(entries: u32) -> usize {
    let raw = HEADER_LEN + entries as usize * (64 + 8);
    raw.div_ceil(64) * 64
}

/// Why a block cannot be used.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BlockError {
    #[error("ring size {0} is not a power of two in 1..=65536")]
    BadEntries(u32),
    #[error("ring block of {have} bytes is smaller than the {need} its size needs")]
    TooSmall { have: usize, need: usize },
    #[error("ring block address is not 64-byte aligned")]
    Misaligned,
    #[error("peer ring block is not initialised (bad magic or size)")]
    NotInitialised,
}

fn check_geometry(ptr: NonNull<u8>, len: usize, entries: u32) -> Result<(), BlockError> {
    if entries == 0 || !entries.is_power_of_two() || entries > 1 << 16 {
        return Err(BlockError::BadEntries(entries));
    }
    if len < block_len(entries) {
        return Err(BlockError::TooSmall { have: len, need: block_len(entries) });
    }
    if ptr.as_ptr() as usize % 64 != 0 {
        return Err(BlockError::Misaligned);
    }
    Ok(())
}

/// Our own block: read-write, written only by us.
#[derive(Clone, Copy, Debug)]
pub struct LocalBlock {
    base: NonNull<u8>,
    entries: u32,
}

/// A peer's block: mapped read-only; every value read from it is untrusted.
#[derive(Clone, Copy, Debug)]
pub struct PeerBlock {
    base: NonNull<u8>,
    entries: u32,
}

// SAFETY: (all four) a block is plain shared memory accessed only through
// atomics and volatile copies, so any thread may hold or share a handle; the
// creator of a LocalBlock/PeerBlock guarantees the mapping outlives every copy
// (see `LocalBlock::init` / `PeerBlock::open`).
unsafe impl Send for LocalBlock {}
// SAFETY: as above.
unsafe impl Sync for LocalBlock {}
// SAFETY: as above.
unsafe impl Send for PeerBlock {}
// SAFETY: as above.
unsafe impl Sync for PeerBlock {}

impl LocalBlock {
    /// Initialises a block in our own memory and returns its handle.
    ///
    /// # Safety
    /// `base..base+len` must be writable memory owned by this process, not used
    /// for anything else, and must stay mapped for as long as the returned
    /// handle or any copy of it is used.
    pub unsafe fn init(base: NonNull<u8>, len: usize, entries: u32) -> Result<LocalBlock, BlockError> {
        // SAFETY: forwarded; the caller's guarantee.
        unsafe { Self::init_with_flags(base, len, entries, 0) }
    }

    /// [`init`](Self::init) with the owner's flags ([`FLAG_OTHER_KERNEL`]).
    ///
    /// # Safety
    /// As for [`init`](Self::init).
    pub unsafe fn init_with_flags(base: NonNull<u8>, len: usize, entries: u32, flags: u64) -> Result<LocalBlock, BlockError> {
        check_geometry(base, len, entries)?;
        // SAFETY: the caller guarantees `len` writable bytes at `base`; we checked
        // `len >= block_len(entries)`.
        unsafe { std::ptr::write_bytes(base.as_ptr(), 0, block_len(entries)) };
        let block = LocalBlock { base, entries };
        block.header().entries.entries.store(entries as u64, Ordering::Relaxed);
        block.header().entries.flags.store(flags, Ordering::Relaxed);
        block.header().state.0.store(STATE_OPEN, Ordering::Relaxed);
        // Magic last, with Release: a peer that sees the magic sees the rest.
        block.header().magic.0.store(BLOCK_MAGIC, Ordering::Release);
        Ok(block)
    }

    fn header(&self) -> &Header {
        // SAFETY: `init` checked size and alignment; the memory is ours and mapped.
        unsafe { &*(self.base.as_ptr() as *const Header) }
    }

    pub fn entries(&self) -> u32 {
        self.entries
    }

    /// Writes descriptor slot `index % entries` and marks it published for
    /// `index` (its `seq`, stored last with `Release` by
    /// [`protocol::mark_slot`](crate::protocol::mark_slot): a consumer that
    /// sees the mark sees the whole descriptor). Only the producer calls this.
    #[inline]
    pub fn write_descriptor(&self, index: u64, desc: &Descriptor) {
        let slot = (index & (self.entries as u64 - 1)) as usize;
        let words = desc.to_words();
        // SAFETY: slot < entries, and the descriptor array starts at HEADER_LEN,
        // 64-aligned, inside the block (`block_len`). The peer only reads it.
        let p = unsafe { self.base.as_ptr().add(HEADER_LEN + slot * 64) };
        for (i, w) in words.into_iter().enumerate() {
            if i == SEQ_WORD {
                continue;
            }
            // SAFETY: as above, word `i` < 8 of the slot, 8-aligned; the slot
            // is ours to write (the consumer released what it held, or never
            // saw it).
            unsafe { std::ptr::write_volatile((p as *mut u64).add(i), w) };
        }
        // The word holding the mark, but not the mark: the slot keeps its old
        // mark until the descriptor is complete, and the mark is only ever
        // written atomically (a consumer may be loading it right now).
        let b = words[SEQ_WORD].to_ne_bytes();
        let (head, nseg) = (u32::from_ne_bytes([b[0], b[1], b[2], b[3]]), u16::from_ne_bytes([b[4], b[5]]));
        // SAFETY: bytes 24..28 and 28..30 of the slot (opcode and flags, then
        // nseg: SEQ_OFFSET is 30 = 24 + 6), naturally aligned, ours as above.
        unsafe {
            std::ptr::write_volatile(p.add(SEQ_WORD * 8) as *mut u32, head);
            std::ptr::write_volatile(p.add(SEQ_WORD * 8 + 4) as *mut u16, nseg);
        }
        // SAFETY: `seq` is a naturally aligned u16 inside the slot (SEQ_OFFSET
        // is 30 of a 64-aligned slot); only this producer writes it, and only
        // here.
        let seq = unsafe { &*(p.add(SEQ_OFFSET) as *const AtomicU16) };
        protocol::mark_slot(seq, lap_mark(index, self.entries));
    }

    /// Writes release slot `index % entries`.
    #[inline]
    pub fn write_release(&self, index: u64, cookie: u64) {
        let slot = (index & (self.entries as u64 - 1)) as usize;
        let off = HEADER_LEN + self.entries as usize * 64 + slot * 8;
        // SAFETY: in bounds by `block_len`; 8-aligned since HEADER_LEN and 64*entries are.
        unsafe { std::ptr::write_volatile(self.base.as_ptr().add(off) as *mut u64, cookie) };
    }

    pub fn data_prod(&self) -> &AtomicU64 {
        &self.header().data_prod.index
    }
    /// The futex word a sleeping data consumer waits on (bumped by the producer).
    pub fn data_bell(&self) -> &AtomicU32 {
        &self.header().data_prod.bell
    }
    pub fn data_cons(&self) -> &AtomicU64 {
        &self.header().data_cons.0
    }
    pub fn data_sleep(&self) -> &AtomicU64 {
        &self.header().data_sleep.0
    }
    pub fn rel_prod(&self) -> &AtomicU64 {
        &self.header().rel_prod.index
    }
    /// The futex word a sender waiting for releases sleeps on (bumped by the releaser).
    pub fn space_bell(&self) -> &AtomicU32 {
        &self.header().rel_prod.bell
    }
    pub fn rel_cons(&self) -> &AtomicU64 {
        &self.header().rel_cons.0
    }
    pub fn space_sleep(&self) -> &AtomicU64 {
        &self.header().space_sleep.0
    }
    /// Marks the connection closed by us (the peer reads this to tell a graceful
    /// close from a crash).
    pub fn set_closed(&self) {
        self.header().state.0.store(STATE_CLOSED, Ordering::Release);
    }
}

impl PeerBlock {
    /// Opens a peer's block after checking its geometry and magic.
    ///
    /// # Safety
    /// `base..base+len` must be readable (typically a read-only mapping of the
    /// peer's arena, already bounds-checked against the grant) and must stay
    /// mapped while the handle or any copy is used.
    pub unsafe fn open(base: NonNull<u8>, len: usize, entries: u32) -> Result<PeerBlock, BlockError> {
        check_geometry(base, len, entries)?;
        let block = PeerBlock { base, entries };
        if block.header().magic.0.load(Ordering::Acquire) != BLOCK_MAGIC
            || block.header().entries.entries.load(Ordering::Relaxed) != entries as u64
        {
            return Err(BlockError::NotInitialised);
        }
        Ok(block)
    }

    /// True when the peer said it runs under another kernel
    /// ([`FLAG_OTHER_KERNEL`]): do not sleep on its futex words. Read once at
    /// open; a peer that lies only slows its own connection.
    pub fn other_kernel(&self) -> bool {
        self.header().entries.flags.load(Ordering::Relaxed) & FLAG_OTHER_KERNEL != 0
    }

    fn header(&self) -> &Header {
        // SAFETY: `open` checked size and alignment; the mapping is readable.
        // Only loads are performed (atomic loads of naturally aligned u64 are
        // plain loads, valid on read-only memory; so are `FUTEX_WAIT`s on the
        // bells, which the kernel only reads).
        unsafe { &*(self.base.as_ptr() as *const Header) }
    }

    pub fn entries(&self) -> u32 {
        self.entries
    }

    /// Copies descriptor slot `index % entries` out of peer memory. The copy is
    /// what gets validated and used: the peer may change the slot afterwards.
    #[inline]
    pub fn read_descriptor(&self, index: u64) -> Descriptor {
        let slot = (index & (self.entries as u64 - 1)) as usize;
        // SAFETY: in bounds and 64-aligned (see LocalBlock::write_descriptor).
        let p = unsafe { self.base.as_ptr().add(HEADER_LEN + slot * 64) } as *const u64;
        // SAFETY: word `i` < 8 of that slot; volatile because another process
        // may write it concurrently; any bit pattern is a valid word.
        let words = std::array::from_fn(|i| unsafe { std::ptr::read_volatile(p.add(i)) });
        Descriptor::from_words(words)
    }

    /// Whether slot `index % entries` holds the descriptor of `index` (its
    /// mark is that lap's, [`lap_mark`]); `Acquire`, so a following
    /// [`PeerBlock::read_descriptor`] sees everything written before the mark.
    #[inline]
    pub fn slot_published(&self, index: u64) -> bool {
        let slot = (index & (self.entries as u64 - 1)) as usize;
        // SAFETY: in bounds (see LocalBlock::write_descriptor); an aligned
        // atomic load is a plain load, valid on a read-only mapping.
        let seq = unsafe { &*(self.base.as_ptr().add(HEADER_LEN + slot * 64 + SEQ_OFFSET) as *const AtomicU16) };
        protocol::slot_marked(seq, lap_mark(index, self.entries))
    }

    #[inline]
    pub fn read_release(&self, index: u64) -> u64 {
        let slot = (index & (self.entries as u64 - 1)) as usize;
        let off = HEADER_LEN + self.entries as usize * 64 + slot * 8;
        // SAFETY: in bounds and aligned (see LocalBlock::write_release).
        unsafe { std::ptr::read_volatile(self.base.as_ptr().add(off) as *const u64) }
    }

    pub fn data_prod(&self) -> &AtomicU64 {
        &self.header().data_prod.index
    }
    /// The futex word a sleeping data consumer waits on (bumped by the producer).
    pub fn data_bell(&self) -> &AtomicU32 {
        &self.header().data_prod.bell
    }
    pub fn data_cons(&self) -> &AtomicU64 {
        &self.header().data_cons.0
    }
    pub fn data_sleep(&self) -> &AtomicU64 {
        &self.header().data_sleep.0
    }
    pub fn rel_prod(&self) -> &AtomicU64 {
        &self.header().rel_prod.index
    }
    /// The futex word a sender waiting for releases sleeps on (bumped by the releaser).
    pub fn space_bell(&self) -> &AtomicU32 {
        &self.header().rel_prod.bell
    }
    pub fn rel_cons(&self) -> &AtomicU64 {
        &self.header().rel_cons.0
    }
    pub fn space_sleep(&self) -> &AtomicU64 {
        &self.header().space_sleep.0
    }
    #[inline]
    pub fn is_closed(&self) -> bool {
        self.header().state.0.load(Ordering::Acquire) == STATE_CLOSED
    }
}
