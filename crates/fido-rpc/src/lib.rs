//! fido-rpc: VMRPC on Fido — remote procedure calls with no serialization.
//!
//! A service is a Rust trait marked `#[fido_rpc::service]`; the macro
//! generates the client stubs (`<Trait>Client`, `<Trait>AsyncClient`) and the
//! server's dispatch table (`<Trait>Server`). Arguments and results are plain
//! old data ([`Pod`]: no padding, no pointers) and handles into arena memory
//! ([`ShmSlice`], [`ShmStr`], and structs nesting them). The caller builds its
//! arguments in its own arena ([`Frame`]); the call carries their global
//! pointers; the server reads them in place, read-only, after checking each
//! range against the caller's grant ([`View`]); results come back the same
//! way, and a [`Reply`] keeps them valid exactly until it is dropped.
//!
//! This crate must never dereference a pointer a peer sent before checking
//! its whole range against that peer's grant, never read a header twice (it
//! is copied out once, then checked), never hand out a view that can outlive
//! the message that keeps its memory mapped, and never let one client's calls
//! (or death) disturb another connection. Everything runs over `fido`
//! channels: no bytes of arguments or results are copied by the transport.

extern crate self as fido_rpc;

#[cfg(feature = "tokio")]
mod asynch;
mod client;
mod error;
mod frame;
mod server;
pub mod wire;

#[cfg(feature = "tokio")]
pub use asynch::AsyncClient;
pub use bytemuck::{self, Pod, Zeroable};
pub use client::{reply_parts, CallOpts, CancelToken, Client, Reply};
pub use error::{CallError, Failure, Fault, RpcError};
pub use fido;
pub use fido_rpc_macros::service;
pub use frame::{Frame, PeerMemory, ShmStrRef, ShmVec, View};
#[cfg(any(fuzzing, feature = "test-hooks"))]
pub use server::dispatch_call;
pub use server::{parse_call, CallBytes, reply_message, Ctx, Dispatch, Incoming, Outcome, Server, ServerHandle, ServerOptions};
pub use wire::{monotonic_ns, NoAppError, ShmSlice, ShmStr};

/// Memory of finished calls (argument frames a server released, reply frames
/// a client released) is collected before the next call once more than this
/// is out; below it, in batches when half the ring is out. Collecting costs a
/// cache-line transfer from the peer, which a null call cannot afford each
/// time, while a large frame must come back before the next one is built
/// (found by `fido-bench rpc`: 10 MB frames piled up until the arena ran out).
pub(crate) const REAP_ABOVE: u64 = 256 << 10;

/// Re-exported for generated code.
#[doc(hidden)]
pub mod __private {
    pub use crate::wire::{sig_hash, RootWriter};
}
