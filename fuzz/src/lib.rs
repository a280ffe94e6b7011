//! Checks shared by Fido's fuzz targets and by the stable-toolchain corpus
//! replay tests (crates/fido-proto/tests/corpus.rs,
//! crates/fido-registry/tests/corpus.rs, crates/fido/tests/corpus.rs,
//! crates/fido-rpc/tests/fuzz_corpus.rs, crates/fido-broker/tests/resume_corpus.rs,
//! crates/fido-broker/tests/net_corpus.rs, crates/fido-broker/tests/fuzz_corpus.rs,
//! crates/fido-vm/tests/guest_link_corpus.rs include these files with `#[path]`).

pub mod broker_session;
pub mod descriptor;
pub mod guest_link;
pub mod net_request;
pub mod proto_check;
pub mod registry_ops;
pub mod resume_check;
pub mod rpc_dispatch;
