//! The broker's MMNet request path: `NetOffer`/`NetClaim`/... decoding and
//! the kernel replies (sock_diag, rtnetlink) it parses to check them
//! (see src/net_request.rs).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    fido_fuzz::net_request::check(data);
});
