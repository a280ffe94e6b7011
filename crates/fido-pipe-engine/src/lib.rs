//! The pipe engine (vPipe): moves bytes between descriptors the broker's
//! clients handed it, sharing the machine among domains by weight.
//!
//! One engine thread owns one io_uring. Every transfer is a small state
//! machine that moves a chunk at a time through a kernel pipe of its own:
//! `splice(source → pipe)` then `splice(pipe → sink)` until the chunk is
//! delivered, with explicit offsets on files (the shared file position is never
//! used or moved). The splices run in the kernel's io-wq workers, so a
//! descriptor that stalls forever (a socket nobody reads, a pipe nobody writes)
//! only stalls its own transfer, and it can be cancelled (`IORING_OP_ASYNC_CANCEL`
//! interrupts the blocked worker). A source or sink that the client set
//! `O_NONBLOCK` returns `EAGAIN`: the transfer then waits with a cancellable
//! `IORING_OP_POLL_ADD` and retries; the engine never changes a descriptor's flags.
//!
//! Sharing: every chunk is a scheduling decision, made by the pure
//! [`sched::Scheduler`] (no clock, no I/O; tested with a fake clock). Each
//! domain has a weight and a credit balance in bytes. Credits are refilled
//! from the engine's capacity (calibrated when the first transfer arrives,
//! configured, or unlimited) in proportion to the
//! weights of the domains that have work, and charged with the bytes actually
//! delivered to the sink. A domain may start a chunk while it has credits; with
//! the work-conserving option a domain out of credits may still start one when
//! no domain with credits is waiting (the paper's "very low priority"). Among
//! the eligible domains the one with the least weighted service so far
//! (bytes / weight, a virtual time that is brought forward when a domain becomes
//! busy, so idling banks nothing) goes first. At most `lanes` chunks are moved at
//! once; a chunk that takes longer than [`SLOW`] stops counting against the lanes,
//! so a stalled transfer never holds the others up.
//!
//! The broker validates requests and descriptors ([`checks`]) and hands jobs
//! to [`Engine`] over a channel; results come back over another one, with an
//! eventfd the broker's main loop polls.
//!
//! What it must never do: touch the broker's state or know its protocol
//! beyond the pipe types of `fido-proto` (policy, quotas and replies are the
//! broker's); block the caller's thread (every command is a channel send);
//! change a descriptor's flags or move a file's shared position (explicit
//! offsets only); let one stalled descriptor hold up other transfers; read
//! the clock or do I/O in the scheduler.

mod calibrate;
mod caller;
pub mod checks;
mod config;
mod engine;
mod files;
pub mod sched;

pub use caller::Caller;
pub use checks::{check_fd, check_op, check_overlap};
pub use config::{parse_size, Capacity, PipeConfig};
pub use engine::{
    Done, Engine, JobSpec, StartError, IOWQ_MAX_WORKERS, MAX_SPLICES_PER_CALLER, SLOW,
};
