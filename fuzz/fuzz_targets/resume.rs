//! The broker's resume check (`fido_broker::resume::check_resume`): any
//! resume, from any uid, against a recorded world, is accepted only with the
//! recorded domain's proof (uid, slot, secret) and within the limits, and
//! then admits only mappings and connections on record for that domain —
//! never a panic (`src/resume_check.rs`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    fido_fuzz::resume_check::check(data);
});
