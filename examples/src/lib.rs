//! Sample services built on Fido, shared by the runnable examples, fido-rpc's
//! tests and examples, the fuzz target of its dispatch and the `fido-bench rpc`
//! suite.
//!
//! * [`services::bench`]: the VMRPC paper's benchmark service (a null call and the
//!   Table 2 sequences ByteSeq, FixedSeq, VarSeq, each touched by the server).
//! * [`services::files`]: the case study, a file server whose reads are zero-copy
//!   views of its cache.
//!
//! This crate is never shipped and no shipped crate may depend on it: it shows
//! how applications use the libraries; the libraries must not carry it.

#![forbid(unsafe_code)]

pub mod services {
    pub mod bench;
    pub mod files;
}
