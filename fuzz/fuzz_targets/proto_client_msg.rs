//! `fido_proto::decode::<ClientMsg>` on arbitrary bytes: never panics, and what
//! it accepts round-trips (see src/proto_check.rs).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    fido_fuzz::proto_check::round_trip::<fido_proto::ClientMsg>(data);
});
