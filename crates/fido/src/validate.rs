//! Validation of descriptors read from a peer's ring.
//!
//! A descriptor is 64 bytes of peer-controlled data. Before any pointer in it is
//! used, every segment is resolved against the granted mappings (slot mapped,
//! offset + length inside the arena, no overflow), an SG list is copied out of
//! peer memory **once** and then checked (so the peer cannot change it between
//! check and use), and the lengths must add up. A descriptor that fails is an
//! error on its connection, never a read outside a granted region.
//!
//! Ranges are validated, not bytes: the payload itself is the peer's business.

use fido_ring::{Descriptor, Segment, FLAG_INLINE, FLAG_SG_LIST, INLINE_BYTES, INLINE_SEGMENTS, MAX_SEGMENTS};
use fido_shm::GPtr;
use smallvec::SmallVec;
use std::ptr::NonNull;

/// Turns a global pointer range into a local one, or says why not.
pub trait Resolver {
    /// What keeps the resolved memory mapped (an `Arc<Mapping>` in the library).
    type Keep;
    fn resolve(&self, g: GPtr, len: u64) -> Result<(NonNull<u8>, Self::Keep), String>;
}

/// One checked segment.
pub struct ValidSegment<K> {
    pub ptr: NonNull<u8>,
    pub len: usize,
    /// The segment as the peer sent it (for forwarding unchanged).
    pub global: Segment,
    pub keep: K,
}

/// A descriptor whose every range was checked.
pub struct Validated<K> {
    pub segments: SmallVec<[ValidSegment<K>; 2]>,
    pub total_len: u64,
    /// The SG list pointer, when the message came with one (forwarded as is).
    pub sg_list: Option<(Segment, K)>,
    /// The payload of an inline message (its first `total_len` bytes), copied
    /// out with the descriptor.
    pub inline: Option<[u8; INLINE_BYTES]>,
}

/// Why a descriptor was rejected.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum Invalid {
    #[error("unknown descriptor flags {0:#x}")]
    Flags(u16),
    #[error("segment count {0} out of range")]
    SegmentCount(u16),
    #[error("segment {index}: empty")]
    EmptySegment { index: usize },
    #[error("segment {index}: {reason}")]
    Segment { index: usize, reason: String },
    #[error("SG list: {0}")]
    SgList(String),
    #[error("total length {claimed} does not match the segments' {actual}")]
    TotalLength { claimed: u64, actual: u64 },
    #[error("message length overflows")]
    Overflow,
    #[error("inline message of {0} bytes (at most {INLINE_BYTES} fit)")]
    InlineLength(u64),
}

/// The whole check of an inline descriptor beyond its flags (it carries no
/// pointer): no segments, and a length that fits.
#[inline]
pub fn check_inline(desc: &Descriptor) -> Result<(), Invalid> {
    if desc.nseg != 0 {
        return Err(Invalid::SegmentCount(desc.nseg));
    }
    if desc.total_len > INLINE_BYTES as u64 {
        return Err(Invalid::InlineLength(desc.total_len));
    }
    Ok(())
}

/// Checks a descriptor copied out of peer memory.
pub fn validate<R: Resolver>(desc: &Descriptor, resolver: &R) -> Result<Validated<R::Keep>, Invalid> {
    if desc.flags & !(FLAG_SG_LIST | FLAG_INLINE) != 0 || desc.flags == FLAG_SG_LIST | FLAG_INLINE {
        return Err(Invalid::Flags(desc.flags));
    }
    if desc.is_inline() {
        check_inline(desc)?;
        return Ok(Validated { segments: SmallVec::new(), total_len: desc.total_len, sg_list: None, inline: Some(desc.inline_area()) });
    }
    let nseg = desc.nseg as usize;
    let mut segments = SmallVec::new();
    let mut total: u64 = 0;
    let mut add = |index: usize, seg: Segment, segments: &mut SmallVec<[ValidSegment<R::Keep>; 2]>| {
        if seg.len == 0 {
            return Err(Invalid::EmptySegment { index });
        }
        let len = usize::try_from(seg.len).map_err(|_| Invalid::Overflow)?;
        let (ptr, keep) = resolver
            .resolve(GPtr(seg.addr), seg.len)
            .map_err(|reason| Invalid::Segment { index, reason })?;
        total = total.checked_add(seg.len).ok_or(Invalid::Overflow)?;
        segments.push(ValidSegment { ptr, len, global: seg, keep });
        Ok(())
    };
    let mut sg_list = None;
    if desc.has_sg_list() {
        if nseg == 0 || nseg > MAX_SEGMENTS {
            return Err(Invalid::SegmentCount(desc.nseg));
        }
        let list = desc.segments[0];
        let bytes = nseg as u64 * std::mem::size_of::<Segment>() as u64;
        if list.len != bytes {
            return Err(Invalid::SgList(format!("length {} for {} segments", list.len, nseg)));
        }
        let (ptr, keep) = resolver.resolve(GPtr(list.addr), bytes).map_err(Invalid::SgList)?;
        if ptr.as_ptr() as usize % std::mem::align_of::<Segment>() != 0 {
            return Err(Invalid::SgList("misaligned".into()));
        }
        // Copy the whole list out first: the peer may rewrite it at any time.
        let copied: Vec<Segment> = (0..nseg)
            .map(|i| {
                // SAFETY: `resolve` checked that `bytes` = nseg * 16 bytes at
                // `ptr` lie inside a live mapping (kept by `keep`); the pointer is
                // 8-aligned (checked above); Segment is two u64s, valid for any
                // bits. Volatile: another process may write it concurrently.
                unsafe { std::ptr::read_volatile((ptr.as_ptr() as *const Segment).add(i)) }
            })
            .collect();
        for (i, seg) in copied.into_iter().enumerate() {
            add(i, seg, &mut segments)?;
        }
        sg_list = Some((list, keep));
    } else {
        if nseg > INLINE_SEGMENTS {
            return Err(Invalid::SegmentCount(desc.nseg));
        }
        for i in 0..nseg {
            add(i, desc.segments[i], &mut segments)?;
        }
    }
    if total != desc.total_len {
        return Err(Invalid::TotalLength { claimed: desc.total_len, actual: total });
    }
    Ok(Validated { segments, total_len: total, sg_list, inline: None })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_good_and_rejects_forged() {
        const B: u64 = 1 << 40;
        struct Arena(Vec<u64>);
        impl Resolver for Arena {
            type Keep = ();
            fn resolve(&self, g: GPtr, len: u64) -> Result<(NonNull<u8>, ()), String> {
                let off = g.0.checked_sub(1 << 40).ok_or("below")?;
                if off.checked_add(len).is_none_or(|e| e > self.0.len() as u64 * 8) {
                    return Err("outside".into());
                }
                // SAFETY: `off + len` was checked to lie inside the test arena just above.
                Ok((NonNull::new(unsafe { (self.0.as_ptr() as *mut u8).add(off as usize) }).unwrap(), ()))
            }
        }
        // SG list with two segments, stored in the arena at offset 64.
        let mut a = vec![0u64; 16];
        a[8] = B;
        a[9] = 8;
        a[10] = B + 8;
        a[11] = 24;
        let r = Arena(a);
        let seg = |addr, len| Segment { addr, len };
        let d = Descriptor { total_len: 32, nseg: 2, flags: FLAG_SG_LIST, segments: [seg(B + 64, 32), seg(0, 0)], ..Default::default() };
        let v = validate(&d, &r).unwrap();
        assert_eq!(v.segments.len(), 2);
        assert_eq!(v.total_len, 32);
        // An inline message: its bytes come with the descriptor, no pointer.
        let mut d = Descriptor::default();
        d.set_inline(b"thirty-two bytes at most, here!!").unwrap();
        let v = validate(&d, &r).unwrap();
        assert!(v.segments.is_empty());
        assert_eq!(&v.inline.unwrap()[..v.total_len as usize], b"thirty-two bytes at most, here!!");
        assert!(Descriptor::default().set_inline(&[0; 33]).is_none());
        let bad = [
            Descriptor { total_len: 8, nseg: 1, segments: [seg(B + 1000, 8), seg(0, 0)], ..Default::default() },
            Descriptor { total_len: 8, nseg: 1, segments: [seg(B - 8, 8), seg(0, 0)], ..Default::default() },
            Descriptor { total_len: u64::MAX, nseg: 1, segments: [seg(B, u64::MAX), seg(0, 0)], ..Default::default() },
            Descriptor { total_len: 9, nseg: 1, segments: [seg(B, 8), seg(0, 0)], ..Default::default() },
            Descriptor { total_len: 8, nseg: 3, segments: [seg(B, 8), seg(0, 0)], ..Default::default() },
            Descriptor { total_len: 8, nseg: 1, flags: 0x80, segments: [seg(B, 8), seg(0, 0)], ..Default::default() },
            Descriptor { total_len: 0, nseg: 1, segments: [seg(B, 0), seg(0, 0)], ..Default::default() },
            Descriptor { total_len: 32, nseg: 2, flags: FLAG_SG_LIST, segments: [seg(B + 120, 32), seg(0, 0)], ..Default::default() },
            Descriptor { total_len: 32, nseg: 2000, flags: FLAG_SG_LIST, segments: [seg(B + 64, 32000), seg(0, 0)], ..Default::default() },
            // Inline: too long, with segments, or also claiming an SG list.
            Descriptor { total_len: 33, flags: FLAG_INLINE, ..Default::default() },
            Descriptor { total_len: 8, nseg: 1, flags: FLAG_INLINE, segments: [seg(B, 8), seg(0, 0)], ..Default::default() },
            Descriptor { total_len: 8, nseg: 0, flags: FLAG_INLINE | FLAG_SG_LIST, ..Default::default() },
        ];
        for (i, d) in bad.iter().enumerate() {
            assert!(validate(d, &r).is_err(), "forged descriptor {i} accepted");
        }
    }
}
