//! The broker's whole request path, stateful, with clients of different
//! uids, checked after every step (see src/broker_session.rs).
#![no_main]

use libfuzzer_sys::fuzz_target;

/// AddressSanitizer's defaults for this binary: the bundled SQLite (through
/// fido-registry) defines two function-local statics named `aiOff`, which
/// ASan's one-definition-rule check reports as one global defined twice.
#[no_mangle]
pub extern "C" fn __asan_default_options() -> *const std::os::raw::c_char {
    c"detect_odr_violation=0".as_ptr()
}

fuzz_target!(|data: &[u8]| {
    fido_fuzz::broker_session::run(data);
});
