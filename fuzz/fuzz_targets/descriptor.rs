//! Descriptor validation (`fido::validate`): an arbitrary 64-byte descriptor
//! against an arbitrary arena must be rejected or yield segments that lie
//! inside the arena and add up to the claimed length — never a panic, never a
//! read outside the arena.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    fido_fuzz::descriptor::check(data);
});
