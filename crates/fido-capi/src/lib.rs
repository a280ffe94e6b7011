//! The C ABI of Fido, declared in `include/fido.h`.
//!
//! This crate is a thin, panic-free shell: each `extern "C"` function checks its
//! arguments (null pointers, lengths, handles), calls the safe Rust API of the crate
//! that owns the concept, and turns the outcome into a return code. It must never hold
//! logic of its own, never let a Rust panic unwind into C, and never trust a pointer
//! it was handed beyond what the header documents.
//!
//! Modules: `rpc` (VMRPC heaps, bind, call by index, serve — `include/fido/rpc.h`),
//! `pipe` (vPipe — `include/fido/pipe.h`) and `blk` (fido-blk clients — `include/fido/blk.h`).

#![allow(clippy::missing_safety_doc, non_camel_case_types)]

pub mod blk;
pub mod pipe;
pub mod rpc;
