//! The chaos run's messages: 1–3 segments whose first starts with a 64-byte
//! header (magic, tag, total length, segment count, a 64-bit hash of every
//! payload byte after the header, the tag of the request it answers), built by
//! senders ([`build`]) and checked by every final receiver ([`verify`]); tags
//! (`stream << 40 | seq`) and the seeded generator behind sizes, contents and
//! the kill schedule ([`Rng`]).

use anyhow::Context as _;
use fido::{Domain, Message, Msg};

const MAGIC: u64 = 0x736f_6168_6364_6966; // "fidchaos"
const HDR: usize = 64;
const MAX_BODY: u64 = 16 << 10;
pub(super) const SEQ_BITS: u32 = 40;
pub(super) const SEQ_MASK: u64 = (1 << SEQ_BITS) - 1;

/// xorshift64* (Vigna), seeded through splitmix64.
#[derive(Clone)]
pub(super) struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        let mut z = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        Rng((z ^ (z >> 31)) | 1)
    }
    pub fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next() % n
        }
    }
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi.saturating_sub(lo) + 1)
    }
    pub fn chance(&mut self, p: f64) -> bool {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64 <= p
    }
}

pub(super) fn tag_of(stream: u64, seq: u64) -> u64 {
    (stream << SEQ_BITS) | (seq & SEQ_MASK)
}

pub(super) fn split_tag(tag: u64) -> (u64, u64) {
    (tag >> SEQ_BITS, tag & SEQ_MASK)
}

#[inline]
fn mix(h: u64, w: u64) -> u64 {
    (h ^ w).wrapping_mul(0x9E37_79B9_7F4A_7C15).rotate_left(31)
}

/// Hash of one segment's payload bytes (words, then the tail).
fn hash_bytes(bytes: &[u8]) -> u64 {
    let mut h = 0x5851_F42D_4C95_7F2D ^ bytes.len() as u64;
    let mut chunks = bytes.chunks_exact(8);
    for c in &mut chunks {
        h = mix(h, u64::from_le_bytes(c.try_into().unwrap()));
    }
    let mut tail = [0u8; 8];
    let r = chunks.remainder();
    tail[..r.len()].copy_from_slice(r);
    mix(h, u64::from_le_bytes(tail) ^ ((r.len() as u64) << 56))
}

/// The end-to-end checksum: every payload byte after the header, segment by
/// segment, order-sensitive.
fn payload_hash<'a>(segments: impl Iterator<Item = &'a [u8]>) -> u64 {
    let mut h = 0xC0FF_EE00_D15E_A5E5u64;
    for (i, s) in segments.enumerate() {
        let body = if i == 0 { &s[HDR.min(s.len())..] } else { s };
        h = mix(h, hash_bytes(body) ^ (i as u64).rotate_left(48));
    }
    h ^ (h >> 33)
}

fn fill(bytes: &mut [u8], seed: u64) {
    let mut r = Rng::new(seed);
    let mut chunks = bytes.chunks_exact_mut(8);
    for c in &mut chunks {
        c.copy_from_slice(&r.next().to_le_bytes());
    }
    let w = r.next().to_le_bytes();
    let rem = chunks.into_remainder();
    let n = rem.len();
    rem.copy_from_slice(&w[..n]);
}

/// Builds a message of 1–3 segments from our arena, every byte written.
pub(super) fn build(d: &Domain, rng: &mut Rng, tag: u64, ref_tag: u64) -> anyhow::Result<Message> {
    let body = rng.below(MAX_BODY + 1) as usize;
    let mut nseg = 1 + rng.below(3) as usize;
    if body < 2 {
        nseg = 1;
    }
    // Cut the body into nseg parts; every segment after the first non-empty.
    let mut lens = vec![0usize; nseg];
    let mut left = body;
    for (i, l) in lens.iter_mut().enumerate().skip(1) {
        let rest = nseg - i; // segments still to fill, this one included
        let max = left - (rest - 1);
        *l = 1 + rng.below(max.saturating_sub(1) as u64 / 2 + 1) as usize;
        *l = (*l).min(max);
        left -= *l;
    }
    lens[0] = HDR + left;
    let mut bufs = Vec::with_capacity(nseg);
    for (i, &l) in lens.iter().enumerate() {
        let mut b = d.alloc(l).context("allocating a message buffer")?;
        b.truncate(l);
        let start = if i == 0 { HDR } else { 0 };
        fill(&mut b[start..], tag ^ ((i as u64) << 60) ^ 0xA5A5);
        bufs.push(b);
    }
    let total: usize = lens.iter().sum();
    let h = payload_hash(bufs.iter().map(|b| &b[..]));
    let fields = [MAGIC, tag, total as u64, nseg as u64, h, ref_tag, 0, 0];
    for (i, f) in fields.iter().enumerate() {
        bufs[0][i * 8..i * 8 + 8].copy_from_slice(&f.to_le_bytes());
    }
    Ok(Message::gather(bufs).tag(tag))
}

/// Checks a received message against its header and descriptor; returns the
/// tag of the request it answers (0: none).
pub(super) fn verify(m: &Msg) -> Result<u64, String> {
    // Copied out once, then checked: the sender could change its memory
    // between two reads in place.
    let owned: Vec<Vec<u8>> = m.segments().map(|s| s.to_vec()).collect();
    let segs: Vec<&[u8]> = owned.iter().map(Vec::as_slice).collect();
    let Some(first) = segs.first() else {
        return Err("no segments".into());
    };
    if first.len() < HDR {
        return Err(format!(
            "first segment {} B, shorter than the header",
            first.len()
        ));
    }
    let w = |i: usize| u64::from_le_bytes(first[i * 8..i * 8 + 8].try_into().unwrap());
    if w(0) != MAGIC {
        return Err(format!("bad magic {:#x}", w(0)));
    }
    if w(1) != m.tag() {
        return Err(format!(
            "header tag {:#x} != descriptor tag {:#x}",
            w(1),
            m.tag()
        ));
    }
    if w(2) != m.len() as u64 {
        return Err(format!(
            "header length {} != descriptor length {}",
            w(2),
            m.len()
        ));
    }
    if w(3) != segs.len() as u64 {
        return Err(format!("header says {} segments, got {}", w(3), segs.len()));
    }
    let h = payload_hash(segs.iter().copied());
    if h != w(4) {
        return Err(format!("checksum {h:#x} != {:#x}", w(4)));
    }
    Ok(w(5))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_roundtrip() {
        let t = tag_of(123, 456);
        assert_eq!(split_tag(t), (123, 456));
    }

    #[test]
    fn hash_sees_a_flipped_bit() {
        let mut a = vec![0u8; 4096];
        fill(&mut a, 7);
        let h = payload_hash([&a[..]].into_iter());
        a[HDR + 100] ^= 1;
        assert_ne!(h, payload_hash([&a[..]].into_iter()));
    }
}
