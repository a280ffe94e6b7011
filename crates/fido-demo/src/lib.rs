//! Fido's demonstration pipeline, shared by `fido demo` and the benchmark tool.
//!
//! * [`proc`]: helper processes (re-executed copies of the running binary), an
//!   embedded broker, and the SIGINT/SIGTERM flag — the things that must never
//!   be left behind.
//! * [`pipeline`]: a zero-copy pipeline across processes (source → forwarders →
//!   sink, one domain each), every message checked end to end at the sink.
//! * [`uds`]: the same pipeline over Unix stream sockets, the demo's baseline
//!   (the same roles' work, the same checks, the same latency phase).
//! * [`demo`]: `fido demo` — both pipelines, throughput at full load and
//!   latency with one message in flight, with the checks that decide its
//!   exit status.
//! * [`vm`]: `fido demo --vm`, the forwarders inside QEMU guests.
//! * [`blk`]: `fido demo --blk`, a guest's ext4 on a RAID-1 of storage
//!   domains, one killed and restarted mid-write.
//! * [`text`]: plain-text tables for the terminal.
//!
//! The running binary must dispatch the hidden subcommand `__demo-role` to
//! [`pipeline::role_main`]: the roles are that binary re-executed.
//!
//! What this crate must never do: leave anything behind — every helper process
//! it starts is killed and reaped on every path (and dies with its parent
//! through `PR_SET_PDEATHSIG`), an embedded broker is shut down (its socket
//! removed) and its temporary directory deleted, also on Ctrl-C; print a figure
//! it did not measure in the same run, or report success when a check failed;
//! and depend on the benchmark baselines (`fido-bench`): the product stands
//! alone.

#![forbid(unsafe_code)]

/// `println!` that does not panic when the reader went away (`fido demo |
/// head`): the demo runs to the end, cleans up, and what no one reads is
/// dropped.
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), $($arg)*);
    }};
}

/// `print!`, likewise.
macro_rules! say_raw {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = write!(std::io::stdout(), $($arg)*);
    }};
}

pub mod blk;
pub mod demo;
pub mod measure;
pub mod pipeline;
pub mod proc;
pub mod text;
pub mod uds;
pub mod vm;
