//! A VM supervisor's relay between a hostile guest's control port and the
//! broker, stateful, with fake devices and a real broker socket, checked
//! after every step (see src/guest_link.rs).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    fido_fuzz::guest_link::run(data);
});
