//! `fido::validate` on any descriptor a peer could publish: an arbitrary
//! 64-byte descriptor against an arbitrary arena must be rejected or yield
//! segments that lie inside the arena and add up to the claimed length —
//! never a panic, never a read outside the arena.
//!
//! Used by the `descriptor` fuzz target and, on stable, by
//! crates/fido/tests/corpus.rs (which includes this file with `#[path]`):
//! only fido's public API.

use fido::validate::{validate, Resolver};
use fido::{Descriptor, GPtr, Segment, INLINE_BYTES};
use std::ptr::NonNull;

/// Validates an arbitrary 64-byte descriptor (and an arbitrary "arena" built
/// from the rest of the input) against a resolver that grants exactly that
/// arena, and checks that every accepted segment lies inside it.
pub fn check(data: &[u8]) {
    if data.len() < 64 {
        return;
    }
    let mut raw = [0u8; 64];
    raw.copy_from_slice(&data[..64]);
    let words: [u64; 8] = std::array::from_fn(|i| u64::from_le_bytes(raw[i * 8..i * 8 + 8].try_into().unwrap()));
    let desc = Descriptor {
        cookie: words[0],
        tag: words[1],
        total_len: words[2],
        opcode: words[3] as u16,
        flags: (words[3] >> 16) as u16,
        nseg: (words[3] >> 32) as u16,
        seq: (words[3] >> 48) as u16,
        segments: [Segment { addr: words[4], len: words[5] }, Segment { addr: words[6], len: words[7] }],
    };
    // The arena: the rest of the input, at global address 1 << 40, 8-aligned copy.
    let arena: Vec<u64> = data[64..].chunks(8).map(|c| {
        let mut b = [0u8; 8];
        b[..c.len()].copy_from_slice(c);
        u64::from_le_bytes(b)
    }).collect();
    struct Fake<'a>(&'a [u64]);
    const BASE: u64 = 1 << 40;
    impl Resolver for Fake<'_> {
        type Keep = ();
        fn resolve(&self, g: GPtr, len: u64) -> Result<(NonNull<u8>, ()), String> {
            let size = self.0.len() as u64 * 8;
            let off = g.0.checked_sub(BASE).ok_or("below arena")?;
            if off.checked_add(len).is_none_or(|end| end > size) {
                return Err("outside arena".into());
            }
            let base = NonNull::new(self.0.as_ptr() as *mut u8).unwrap_or(NonNull::dangling());
            // SAFETY: off + len <= size, so off is within (or one past) the buffer.
            Ok((unsafe { base.add(off as usize) }, ()))
        }
    }
    let fake = Fake(&arena);
    if let Ok(v) = validate(&desc, &fake) {
        let lo = arena.as_ptr() as usize;
        let hi = lo + arena.len() * 8;
        let mut sum = 0u64;
        for s in &v.segments {
            let p = s.ptr.as_ptr() as usize;
            assert!(p >= lo && p + s.len <= hi, "accepted segment outside the arena");
            sum += s.len as u64;
        }
        if v.inline.is_some() {
            assert!(v.segments.is_empty() && desc.total_len <= INLINE_BYTES as u64, "inline message with segments or too long");
        } else {
            assert_eq!(sum, desc.total_len);
        }
    }
}
