//! fido-blk (MMBlk): block devices served by isolated storage domains over
//! Fido channels (docs/BLK.md).
//!
//! A storage domain offers `blk:NAME` and serves reads, writes, flushes
//! (FUA), discards and write-zeroes with many requests in flight and
//! out-of-order completion ([`serve`], backed by a [`FileBackend`]: a file,
//! a block device or a RAM disk through io_uring, or by any [`BlockBackend`],
//! e.g. a RAID composition of other block services). Clients use
//! [`BlkClient`]. Write payloads are buffers of the client's arena that the
//! storage domain hands to the kernel in place; read data lands in the
//! storage domain's arena and the client gets a read-only view of it.
//!
//! What this crate must never do: trust a peer (every request is validated
//! in [`proto::check_request`] before a backend sees it, and a broken request
//! costs only its own reply or its own connection); copy a write payload
//! through its own code; keep a client waiting for ever (a lost connection
//! fails every request in flight; a backend that drops a request replies EIO);
//! acknowledge a FLUSH or FUA write before the data is durable.

pub mod backing;
pub mod client;
pub mod proto;
pub mod raid;
pub mod server;

pub use backing::{BackingOptions, FileBackend};
pub use client::{BlkClient, BlkError, Completion};
pub use proto::{Info, Op};
pub use server::{serve, stats_key, BackendQueue, BlockBackend, Replier, Request, ServeOptions, Server, Stats, DEFAULT_READ_BYTES_HELD};
