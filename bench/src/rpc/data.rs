//! The VMRPC paper's Table 2 payloads, how every system generates them and the
//! checksums both ends compute.
//!
//! | type     | definition                                  | payload    |
//! |----------|---------------------------------------------|------------|
//! | ByteSeq  | `char ByteSeq[LEN*10]`                      | `10*LEN` B |
//! | FixedSeq | `struct { int i; int j; double d; }[LEN]`   | `16*LEN` B |
//! | VarSeq   | `struct { char *s; double d; }[LEN]`        | `18*LEN` B |
//!
//! VarSeq's strings are [`VAR_STR`] = 10 bytes each, so its payload is the
//! paper's 18 bytes per element (8 for `d`, 10 for the string it points to).
//!
//! Every element depends on the call's `seed` (a per-call sequence number), so
//! no system can answer from a cache; both ends go through every element. The
//! checksums are plain wrapping sums so the Python XML-RPC peer computes the
//! same value (see `xmlrpc_peer.py`):
//!
//! * ByteSeq: Σ byte.
//! * FixedSeq: Σ (i + j + ⌊d⌋).
//! * VarSeq: Σ (Σ bytes of s + len(s) + ⌊d⌋).

/// Bytes of each VarSeq string.
pub const VAR_STR: usize = 10;

/// The three sequence types of Table 2.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Seq {
    Byte,
    Fixed,
    Var,
}

impl Seq {
    pub const ALL: [Seq; 3] = [Seq::Byte, Seq::Fixed, Seq::Var];

    pub fn name(self) -> &'static str {
        match self {
            Seq::Byte => "byteseq",
            Seq::Fixed => "fixedseq",
            Seq::Var => "varseq",
        }
    }

    pub fn parse(s: &str) -> Option<Seq> {
        Seq::ALL.into_iter().find(|q| q.name() == s)
    }

    /// Actual payload of one call (Table 2's "Volume").
    pub fn payload(self, len: usize) -> u64 {
        len as u64
            * match self {
                Seq::Byte => 10,
                Seq::Fixed => 16,
                Seq::Var => 8 + VAR_STR as u64,
            }
    }

    /// Element count of a call: ByteSeq has `10*LEN` bytes, the others `LEN` structs.
    pub fn elements(self, len: usize) -> usize {
        match self {
            Seq::Byte => len * 10,
            _ => len,
        }
    }
}

/// Which way the sequence travels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dir {
    /// Client → server (an argument); the server folds it and returns the checksum.
    Send,
    /// Server → client (a result); the server builds it fresh and returns its checksum
    /// beside it; the client folds it and compares.
    Recv,
}

impl Dir {
    pub fn name(self) -> &'static str {
        match self {
            Dir::Send => "send",
            Dir::Recv => "recv",
        }
    }
    pub fn parse(s: &str) -> Option<Dir> {
        match s {
            "send" => Some(Dir::Send),
            "recv" => Some(Dir::Recv),
            _ => None,
        }
    }
}

/// One FixedSeq element, laid out as the paper's C struct (16 bytes, no padding).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Fixed {
    pub i: i32,
    pub j: i32,
    pub d: f64,
}

/// One VarSeq element as a Rust program holds it (`tarpc`, and the reference).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Var {
    pub s: String,
    pub d: f64,
}

#[inline]
pub fn byte_at(seed: u64, k: usize) -> u8 {
    (k as u8).wrapping_mul(7).wrapping_add(seed as u8)
}

/// Fills `buf` with the ByteSeq of `seed`; returns its checksum.
#[inline]
pub fn fill_bytes(buf: &mut [u8], seed: u64) -> u64 {
    for (k, b) in buf.iter_mut().enumerate() {
        *b = byte_at(seed, k);
    }
    sum_bytes(buf)
}

/// ByteSeq checksum: Σ byte (vectorizes; reads every byte).
#[inline]
pub fn sum_bytes(buf: &[u8]) -> u64 {
    // Sum in u32 lanes over chunks small enough never to overflow, then widen.
    let mut total = 0u64;
    for chunk in buf.chunks(1 << 16) {
        let s: u32 = chunk.iter().map(|&b| b as u32).sum();
        total = total.wrapping_add(s as u64);
    }
    total
}

#[inline]
pub fn fixed_at(seed: u64, k: usize) -> Fixed {
    Fixed {
        i: ((k as u64 + seed) & 0x7fff_ffff) as i32,
        j: (k & 0xffff) as i32,
        d: (k % 1_000_000) as f64 + 0.5,
    }
}

#[inline]
pub fn fixed_sum(f: &Fixed) -> u64 {
    (f.i as u64)
        .wrapping_add(f.j as u64)
        .wrapping_add(f.d as u64)
}

/// Σ over a FixedSeq.
pub fn sum_fixed(seq: &[Fixed]) -> u64 {
    seq.iter().fold(0u64, |a, f| a.wrapping_add(fixed_sum(f)))
}

/// The `VAR_STR` bytes of element `k`'s string (lowercase ASCII, valid UTF-8).
#[inline]
pub fn var_str_at(seed: u64, k: usize) -> [u8; VAR_STR] {
    let base = (k as u64).wrapping_add(seed);
    let mut s = [0u8; VAR_STR];
    for (m, c) in s.iter_mut().enumerate() {
        *c = b'a' + (base.wrapping_add(m as u64) % 26) as u8;
    }
    s
}

#[inline]
pub fn var_d_at(k: usize) -> f64 {
    (k % 1_000_000) as f64 + 0.25
}

/// Checksum contribution of one VarSeq element.
#[inline]
pub fn var_sum(s: &[u8], d: f64) -> u64 {
    let bytes: u64 = s.iter().map(|&b| b as u64).sum();
    bytes.wrapping_add(s.len() as u64).wrapping_add(d as u64)
}

pub fn var_at(seed: u64, k: usize) -> Var {
    let s = var_str_at(seed, k);
    Var {
        // The bytes are ASCII by construction.
        s: String::from_utf8(s.to_vec()).expect("ascii"),
        d: var_d_at(k),
    }
}

pub fn sum_var(seq: &[Var]) -> u64 {
    seq.iter()
        .fold(0u64, |a, v| a.wrapping_add(var_sum(v.s.as_bytes(), v.d)))
}

/// The checksum of the sequence `(seq, len, seed)` computed without building it:
/// what a client asserts after a `recv` call, and what a `send` call must return.
pub fn expected(seq: Seq, len: usize, seed: u64) -> u64 {
    match seq {
        Seq::Byte => {
            let mut acc = 0u64;
            for k in 0..seq.elements(len) {
                acc = acc.wrapping_add(byte_at(seed, k) as u64);
            }
            acc
        }
        Seq::Fixed => (0..len).fold(0u64, |a, k| a.wrapping_add(fixed_sum(&fixed_at(seed, k)))),
        Seq::Var => (0..len).fold(0u64, |a, k| {
            a.wrapping_add(var_sum(&var_str_at(seed, k), var_d_at(k)))
        }),
    }
}

/// A checksum test hook: with `FIDO_BENCH_RPC_CORRUPT=1` in a Rust server's
/// environment the checksum it returns is off by one, so the test can prove the
/// client's assertion really fails the bench.
pub fn server_sum(sum: u64) -> u64 {
    static CORRUPT: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if *CORRUPT.get_or_init(|| std::env::var("FIDO_BENCH_RPC_CORRUPT").as_deref() == Ok("1")) {
        sum.wrapping_add(1)
    } else {
        sum
    }
}

/// Fails with a clear message when a checksum differs.
pub fn check(what: &str, got: u64, want: u64) -> anyhow::Result<()> {
    if got != want {
        anyhow::bail!("checksum mismatch on {what}: got {got:#x}, expected {want:#x}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_sums_match_expected() {
        for len in [1usize, 7, 100, 1000] {
            for seed in [0u64, 1, 99] {
                let mut b = vec![0u8; Seq::Byte.elements(len)];
                assert_eq!(fill_bytes(&mut b, seed), expected(Seq::Byte, len, seed));
                let f: Vec<Fixed> = (0..len).map(|k| fixed_at(seed, k)).collect();
                assert_eq!(sum_fixed(&f), expected(Seq::Fixed, len, seed));
                let v: Vec<Var> = (0..len).map(|k| var_at(seed, k)).collect();
                assert_eq!(sum_var(&v), expected(Seq::Var, len, seed));
            }
        }
        assert_eq!(std::mem::size_of::<Fixed>(), 16);
        assert_eq!(Seq::Var.payload(100), 1800);
    }

    #[test]
    fn sums_see_every_element() {
        let mut b = vec![0u8; 1000];
        let s = fill_bytes(&mut b, 3);
        b[999] ^= 1;
        assert_ne!(sum_bytes(&b), s);
        let mut f: Vec<Fixed> = (0..10).map(|k| fixed_at(3, k)).collect();
        let s = sum_fixed(&f);
        f[9].j += 1;
        assert_ne!(sum_fixed(&f), s);
    }
}
