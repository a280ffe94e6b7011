//! Test support for Fido's integration tests (dev-only, never published).
//!
//! What several crates' `tests/` need lives here once: a private broker per
//! test in a temporary directory ([`broker`]), this test binary re-executed in
//! a role as a child process ([`child`]), waiting with deadlines ([`wait`]),
//! test users for the cross-uid tests ([`users`]), and the test guest of the
//! VM-domain tests with a plain QEMU launcher and its console ([`vm`]). What
//! only one suite needs is a module named for it: the raw control-protocol
//! client of the broker's tests ([`raw`]), and behind features the helpers of
//! tests whose parties are domains (`domains`), pipes (`pipes`) and MMNet
//! programs (`mmnet`).
//!
//! It must never be a normal dependency of any crate (only
//! `[dev-dependencies]`), and never weaken what a test checks: helpers panic
//! with a message saying what did not happen, instead of returning quietly.

#![forbid(unsafe_code)]

pub mod broker;
pub mod bytes;
pub mod child;
#[cfg(feature = "domains")]
pub mod domains;
#[cfg(feature = "mmnet")]
pub mod mmnet;
#[cfg(feature = "pipes")]
pub mod pipes;
pub mod raw;
pub mod users;
pub mod vm;
pub mod wait;

pub use broker::{Defaults, Preset, TestBroker};
pub use child::{ChildProc, RoleChild};
pub use wait::eventually;
