//! `fido_proto::check_path` + an in-memory `fido_registry::Registry` driven by
//! a byte-coded program of write/read/delete/list/transact/watch/usage ops on
//! fuzzed paths and values, checked step by step against a BTreeMap model;
//! rejected ops must leave `usage("/")` unchanged (see src/registry_ops.rs).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    fido_fuzz::registry_ops::run(data);
});
