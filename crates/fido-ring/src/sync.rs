//! Atomics used by the signalling protocol: `std`'s normally, `loom`'s when the
//! protocol is model-checked (`RUSTFLAGS="--cfg loom" cargo test -p fido-ring --release --test loom`).

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{fence, AtomicU16, AtomicU32, AtomicU64, Ordering};
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{fence, AtomicU16, AtomicU32, AtomicU64, Ordering};
