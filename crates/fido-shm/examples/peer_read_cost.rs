//! The cost of reading through a `PeerSlice` instead of a `&[u8]`, on one
//! core, in L1/L2-resident buffers (no other process involved): the
//! intrinsic part of the cost that docs/ARCHITECTURE.md §3.6 reports.
//!
//! `cargo run --release -p fido-shm --example peer_read_cost`
//!
//! Each line: the plain-slice loop and its `PeerSlice` counterpart, in ns per
//! KiB (best of 15 rounds, alternating), and their ratio.

use fido_shm::PeerSlice;
use std::hint::black_box;
use std::time::Instant;

/// ns per KiB of the fastest of `rounds` runs of `f` over `len` bytes.
fn best(len: usize, reps: usize, mut f: impl FnMut() -> u64) -> f64 {
    let t = Instant::now();
    for _ in 0..reps {
        black_box(f());
    }
    t.elapsed().as_nanos() as f64 / reps as f64 / (len as f64 / 1024.0)
}

fn main() {
    for len in [4 << 10, 64 << 10] {
        let words: Vec<u64> = (0..len as u64 / 8).map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15)).collect();
        let bytes: &[u8] = bytemuck::cast_slice(&words);
        let view = PeerSlice::from_own(bytes);
        let reps = (64 << 20) / len;
        type Case<'a> = (&'a str, Box<dyn Fn() -> u64 + 'a>, Box<dyn Fn() -> u64 + 'a>);
        let cases: Vec<Case> = vec![
            (
                "fold u64 words (bench `touch`)",
                Box::new(|| black_box(bytes).chunks_exact(8).fold(0u64, |a, w| a.wrapping_add(u64::from_ne_bytes(w.try_into().unwrap())).rotate_left(1))),
                Box::new(|| black_box(view).fold_u64(0u64, |a, w| a.wrapping_add(w).rotate_left(1))),
            ),
            (
                "sum bytes (ByteSeq)",
                Box::new(|| black_box(bytes).iter().map(|&b| b as u64).sum()),
                Box::new(|| {
                    let mut s = 0u64;
                    black_box(view).read_chunks(|c| s += c.iter().map(|&b| b as u64).sum::<u64>());
                    s
                }),
            ),
            (
                "sum typed elements (FixedSeq-like)",
                Box::new(|| black_box(&words[..]).iter().fold(0u64, |a, &w| a.wrapping_add(w))),
                Box::new(|| black_box(view).cast::<u64>().unwrap().iter().fold(0u64, |a, w| a.wrapping_add(w))),
            ),
            (
                "copy out (to_vec)",
                Box::new(|| black_box(black_box(bytes).to_vec()).len() as u64),
                Box::new(|| black_box(black_box(view).to_vec()).len() as u64),
            ),
        ];
        for (name, plain, peer) in &cases {
            assert_eq!(plain_result(plain), plain_result(peer), "{name}: same result");
            let (mut p, mut v) = (f64::MAX, f64::MAX);
            for _ in 0..15 {
                p = p.min(best(len, reps, plain));
                v = v.min(best(len, reps, peer));
            }
            println!("{:>3} KiB  {name:<36} slice {p:7.1} ns/KiB  PeerSlice {v:7.1} ns/KiB  x{:.2}", len >> 10, v / p);
        }
    }
}

fn plain_result(f: &dyn Fn() -> u64) -> u64 {
    f()
}
