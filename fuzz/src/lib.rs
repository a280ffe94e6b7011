//! Checks shared by Fido's fuzz targets and by the stable-toolchain corpus
//! replay tests (crates/fido-proto/tests/corpus.rs,
//! crates/fido-registry/tests/corpus.rs include these files with `#[path]`).

pub mod proto_check;
pub mod registry_ops;
pub mod rpc_dispatch;
