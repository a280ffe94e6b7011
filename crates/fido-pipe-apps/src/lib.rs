//! Programs built on Fido's pipe engine, beside its client (`fido-pipe`):
//! what `fido pipe serve` and `fido pipe proxy` run, and what `fido-bench
//! pipe` compares.
//!
//! * [`mover`]: the [`Mover`] trait — move bytes between two descriptors —
//!   and the in-process strategies ([`mover::Sendfile`], [`mover::ReadWrite`]).
//! * [`engine`]: the [`Strategy::Fido`] mover — the broker's pipe engine moves
//!   the bytes; this process only hands it the descriptors.
//! * [`serve`] (feature `serve`): a static-file HTTP/1.1 server whose bodies
//!   go file→socket through a [`Mover`].
//! * [`copy`]: `fido pipe cp` — a file (or stdin) to a file (or stdout)
//!   through the engine, never through this process.
//! * [`proxy`]: a TCP forwarder, both directions socket→socket through a
//!   [`Mover`].
//! * [`peers`]: who a connection's peer is (a local uid, or a remote address)
//!   and the connection limits, in all and per peer, of `serve` and `proxy`;
//!   [`accept`]: their accept loops' pacing when out of descriptors.
//!
//! Programs are written once against [`Mover`], so every comparison changes
//! only the strategy. Unlike `fido-pipe`, whose client never touches payload,
//! this crate does move bytes in-process: the `sendfile` and `readwrite`
//! strategies are the baselines, and the engine mover falls back to
//! `sendfile`/`splice` when the engine declines a request (over quota, no
//! engine) — said once in the log.
//!
//! What this crate must never do: serve anything outside the directory it was
//! given (`..` and symlinks included, also while they change), let one
//! connection hold up another (one thread per connection, deadlines), let one
//! client take every connection, or report a transfer as complete when fewer
//! bytes moved.

#![forbid(unsafe_code)]

pub mod accept;
pub mod copy;
pub mod engine;
pub mod mover;
pub mod peers;
pub mod proxy;
#[cfg(feature = "serve")]
pub mod serve;

pub use mover::{Mover, Strategy};
