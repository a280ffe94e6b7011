//! fido-rpc server dispatch on arbitrary client memory (see src/rpc_dispatch.rs).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = fido_fuzz::rpc_dispatch::run(data);
});
