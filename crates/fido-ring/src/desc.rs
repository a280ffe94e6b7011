//! The 64-byte descriptor: what one message looks like in a ring.

/// Largest number of segments a message may have (inline or in an SG list).
pub const MAX_SEGMENTS: usize = 1024;
/// Segments that fit in the descriptor itself.
pub const INLINE_SEGMENTS: usize = 2;

/// Descriptor flag: `segments[0]` points at an SG list of `nseg` [`Segment`]s in
/// the sender's (or an upstream sender's) arena instead of holding data.
pub const FLAG_SG_LIST: u16 = 1;

/// Descriptor flag: the message's bytes (`total_len` of them, at most
/// [`INLINE_BYTES`]) travel in the descriptor itself, where its segments
/// would be; `nseg` is 0. For small messages (an RPC header): the receiver
/// has them with the descriptor — no second cache line to fetch, nothing
/// allocated in the sender's arena.
pub const FLAG_INLINE: u16 = 2;
/// Largest payload of an inline message (the bytes of the segment array).
pub const INLINE_BYTES: usize = INLINE_SEGMENTS * 16;

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

/// Four `u16`s as the word they make in memory, in order.
#[inline]
fn pack_u16s(v: [u16; 4]) -> u64 {
    let mut b = [0u8; 8];
    for (i, x) in v.iter().enumerate() {
        b[i * 2..i * 2 + 2].copy_from_slice(&x.to_ne_bytes());
    }
    u64::from_ne_bytes(b)
}

#[inline]
fn unpack_u16s(w: u64) -> [u16; 4] {
    let b = w.to_ne_bytes();
    std::array::from_fn(|i| u16::from_ne_bytes([b[i * 2], b[i * 2 + 1]]))
}

/// `bytes` zero-padded to a whole inline area; `None` if they do not fit
/// in [`INLINE_BYTES`].
#[inline]
pub fn inline_area(bytes: &[u8]) -> Option<[u8; INLINE_BYTES]> {
    let n = bytes.len();
    if n > INLINE_BYTES {
        return None;
    }
    // Two fixed-size copies that overlap in the middle, as `memcpy` does for
    // small sizes, but inline: the call cost more than the copy on a polled
    // round trip (both its messages go through here).
    let mut area = [0u8; INLINE_BYTES];
    fn two<const W: usize>(area: &mut [u8; INLINE_BYTES], bytes: &[u8]) {
        let n = bytes.len();
        area[..W].copy_from_slice(&bytes[..W]);
        area[n - W..n].copy_from_slice(&bytes[n - W..]);
    }
    match n {
        16.. => two::<16>(&mut area, bytes),
        8.. => two::<8>(&mut area, bytes),
        4.. => two::<4>(&mut area, bytes),
        _ => area[..n].copy_from_slice(bytes),
    }
    Some(area)
}

impl Descriptor {
    /// True when the segments live in an SG list rather than inline.
    pub fn has_sg_list(&self) -> bool {
        self.flags & FLAG_SG_LIST != 0
    }

    /// True when the payload is in the descriptor ([`FLAG_INLINE`]).
    pub fn is_inline(&self) -> bool {
        self.flags & FLAG_INLINE != 0
    }

    /// Makes this an inline message of `bytes`; `None` if they do not fit in
    /// [`INLINE_BYTES`].
    pub fn set_inline(&mut self, bytes: &[u8]) -> Option<()> {
        let area = inline_area(bytes)?;
        self.set_inline_area(&area, bytes.len());
        Some(())
    }

    /// Makes this an inline message of the first `len` bytes of `area`
    /// (the rest must be zero: it travels too). For a sender that already
    /// has the bytes padded ([`inline_area`]), so they are not copied again.
    #[inline]
    pub fn set_inline_area(&mut self, area: &[u8; INLINE_BYTES], len: usize) {
        debug_assert!(len <= INLINE_BYTES && area[len..].iter().all(|&b| b == 0));
        let word = |i: usize| u64::from_ne_bytes(area[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
        self.segments = [Segment { addr: word(0), len: word(1) }, Segment { addr: word(2), len: word(3) }];
        self.flags = FLAG_INLINE;
        self.nseg = 0;
        self.total_len = len as u64;
    }

    /// The descriptor as the eight words of its slot, in memory order (the
    /// four `u16`s share word 3). The ring copies descriptors in and out
    /// word by word: a copy of the struct as a whole went through the stack
    /// in pieces of other sizes, and reading it back stalled on them
    /// (store-to-load forwarding fails when a load spans two stores).
    #[inline]
    pub fn to_words(&self) -> [u64; 8] {
        let s = self.segments;
        [self.cookie, self.tag, self.total_len, pack_u16s([self.opcode, self.flags, self.nseg, self.seq]), s[0].addr, s[0].len, s[1].addr, s[1].len]
    }

    /// The inverse of [`Descriptor::to_words`].
    #[inline]
    pub fn from_words(w: [u64; 8]) -> Descriptor {
        let [opcode, flags, nseg, seq] = unpack_u16s(w[3]);
        Descriptor {
            cookie: w[0],
            tag: w[1],
            total_len: w[2],
            opcode,
            flags,
            nseg,
            seq,
            segments: [Segment { addr: w[4], len: w[5] }, Segment { addr: w[6], len: w[7] }],
        }
    }

    /// The inline area as bytes, in memory order (the payload is its first
    /// `total_len`, when that is valid — the receiver checks).
    pub fn inline_area(&self) -> [u8; INLINE_BYTES] {
        let mut area = [0u8; INLINE_BYTES];
        for (i, s) in self.segments.iter().enumerate() {
            area[i * 16..i * 16 + 8].copy_from_slice(&s.addr.to_ne_bytes());
            area[i * 16 + 8..i * 16 + 16].copy_from_slice(&s.len.to_ne_bytes());
        }
        area
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_are_the_memory_layout() {
        let d = Descriptor {
            cookie: 0x0102_0304_0506_0708,
            tag: 9,
            total_len: 10,
            opcode: 0x1112,
            flags: 0x1314,
            nseg: 0x1516,
            seq: 0x1718,
            segments: [Segment { addr: 19, len: 20 }, Segment { addr: 21, len: 22 }],
        };
        // SAFETY: `Descriptor` is `repr(C)`, 64 bytes of integers with no
        // padding (asserted above); any 64 bytes are eight valid `u64`s.
        let in_memory: [u64; 8] = unsafe { std::mem::transmute(d) };
        assert_eq!(d.to_words(), in_memory);
        assert_eq!(Descriptor::from_words(in_memory), d);
    }

    #[test]
    fn inline_area_pads_every_length() {
        let src: Vec<u8> = (1..=33).collect();
        for n in 0..=INLINE_BYTES {
            let area = inline_area(&src[..n]).unwrap();
            assert_eq!(&area[..n], &src[..n], "length {n}");
            assert!(area[n..].iter().all(|&b| b == 0), "padding of length {n}");
        }
        assert!(inline_area(&src[..INLINE_BYTES + 1]).is_none());
    }
}
