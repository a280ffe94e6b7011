//! An NBD (Network Block Device) server in front of a block backend, so that
//! the tools people already have — qemu-img, qemu-io, nbdinfo, nbdcopy,
//! `fio --ioengine=nbd`, QEMU's `-drive file=nbd+unix://…` — read and write a
//! Fido block service (`fido blk nbd`).
//!
//! Fixed newstyle negotiation (GO, INFO, EXPORT_NAME, LIST, ABORT,
//! STRUCTURED_REPLY, LIST/SET_META_CONTEXT with `base:allocation`; every other
//! option gets NBD_REP_ERR_UNSUP), then transmission with READ (structured
//! OFFSET_DATA/OFFSET_HOLE chunks), WRITE, FLUSH, FUA, TRIM, WRITE_ZEROES,
//! BLOCK_STATUS and DISC. Each connection has a reader thread that validates
//! and submits requests to its own backend connection ([`Export::open`]) and a
//! writer thread that writes replies as completions arrive, in any order.
//! WRITE payloads are read from the socket straight into the backend's buffer
//! ([`Submitter::write_buf`]); READ data is handed to `sendmsg` by pointer
//! ([`ReadData`]).
//!
//! What this crate must never do: trust a byte from the client (every length,
//! offset, flag and option is checked before it is used, and a bad one costs
//! that client an error or its connection, never the server or other
//! clients); grow memory without bound for a client that sends without reading
//! replies (in-flight backend requests are capped per connection, payloads
//! are read only into a slot already granted); form a Rust reference to READ
//! data the backend lent (it may be another process's memory).

pub mod blk;
pub mod export;
mod handshake;
pub mod memory;
pub mod proto;
mod server;
mod sock;
mod transmission;

pub use blk::BlkExport;
pub use export::{Completer, Completion, Export, ExportInfo, Op, ReadData, Request, Run, Submitter};
pub use memory::{MemoryExport, MemoryOptions};
pub use server::{Listener, NbdServer, ServerConfig};
pub use sock::Stream;
