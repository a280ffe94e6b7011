//! What the fido-blk test binaries share.

/// Deterministic, seed-dependent bytes: what a test writes and checks back.
pub use fido_test_support::bytes::pattern;
