//! The 64-byte descriptor: what one message looks like in a ring.

/// Largest number of segments a message may have (inline or in an SG list).
pub const MAX_SEGMENTS: usize = 1024;
/// Segments that fit in the descriptor itself.
pub const INLINE_SEGMENTS: usize = 2;

/// Descriptor flag: `segments[0]` points at an SG list of `nseg` [`Segment`]s in
/// the sender's (or an upstream sender's) arena instead of holding data.
pub const FLAG_SG_LIST: u16 = 1;

/// One piece of a message: a global pointer and a length.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Segment {
    pub addr: u64,
    pub len: u64,
}

/// A message descriptor. Exactly one cache line.
///
/// `cookie` is chosen by the sender and comes back to it in a release; `tag` and
/// `opcode` belong to the application (e.g. a sequence number, an RPC method).
/// `seq` belongs to the ring: it is the slot's publication mark (see
/// [`crate::block::lap_mark`]); senders leave it 0 and receivers ignore it.
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Descriptor {
    pub cookie: u64,
    pub tag: u64,
    pub total_len: u64,
    pub opcode: u16,
    pub flags: u16,
    pub nseg: u16,
    pub seq: u16,
    pub segments: [Segment; INLINE_SEGMENTS],
}

const _: () = assert!(std::mem::size_of::<Descriptor>() == 64);
const _: () = assert!(std::mem::size_of::<Segment>() == 16);
/// Where `seq` sits in a slot (the ring stores it atomically, last).
pub(crate) const SEQ_OFFSET: usize = std::mem::offset_of!(Descriptor, seq);
const _: () = assert!(SEQ_OFFSET == 30);

impl Descriptor {
    /// True when the segments live in an SG list rather than inline.
    pub fn has_sg_list(&self) -> bool {
        self.flags & FLAG_SG_LIST != 0
    }
}
