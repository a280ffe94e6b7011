//! Replays the committed fuzz corpus of the server dispatch
//! (fuzz/corpus/rpc_dispatch/) through the fuzz target's property
//! (fuzz/src/rpc_dispatch.rs) on stable, without libFuzzer.
//!
//! `cargo test -p fido-rpc --test fuzz_corpus -- --ignored regenerate_seeds`
//! rewrites the hand-written seeds (`seed-*`).

use std::path::{Path, PathBuf};

#[path = "../../../fuzz/src/rpc_dispatch.rs"]
mod rpc_dispatch;

fn corpus() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/rpc_dispatch")
}

#[test]
fn rpc_dispatch_corpus() {
    let mut files: Vec<PathBuf> = std::fs::read_dir(corpus()).unwrap().map(|e| e.unwrap().path()).filter(|p| p.is_file()).collect();
    files.sort();
    assert!(files.len() >= 10, "corpus too small: {}", files.len());
    for f in &files {
        let data = std::fs::read(f).unwrap();
        if std::panic::catch_unwind(|| rpc_dispatch::run(&data)).is_err() {
            panic!("corpus input {} violates the property", f.display());
        }
    }
}

#[test]
fn seeds_are_answered() {
    // Well-formed seeds reach their handlers (not rejected at the header).
    for (name, data) in rpc_dispatch::seeds() {
        let (status, fault) = rpc_dispatch::run(&data).unwrap();
        let expect_fault = match name.as_str() {
            "unknown_method" => Some(fido_rpc::Fault::UnknownMethod),
            "bad_root" => Some(fido_rpc::Fault::BadPointer),
            "inline_short" => Some(fido_rpc::Fault::BadHeader),
            // The file service has no directory: "name" is not found (an
            // application error, status 1), except after the put seed.
            _ => None,
        };
        match expect_fault {
            Some(f) => assert_eq!((status, fault), (2, f as u32), "{name}"),
            None => assert_ne!(status, 2, "{name}: fault {fault}"),
        }
    }
}

#[test]
#[ignore]
fn regenerate_seeds() {
    let dir = corpus();
    std::fs::create_dir_all(&dir).unwrap();
    for (name, data) in rpc_dispatch::seeds() {
        std::fs::write(dir.join(format!("seed-{name}")), data).unwrap();
    }
}
