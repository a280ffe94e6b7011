//! Replays the committed `registry_path` fuzz corpus (fuzz/corpus/registry_path/)
//! through the same differential check the fuzz target runs
//! (fuzz/src/registry_ops.rs: registry vs. a BTreeMap model, rejected ops leave
//! `usage("/")` unchanged), on the stable toolchain and without libFuzzer.
//!
//! `cargo test -p fido-registry --test corpus -- --ignored regenerate_seeds`
//! rewrites the hand-written seed programs (`seed-*`).

use std::path::{Path, PathBuf};

#[path = "../../../fuzz/src/registry_ops.rs"]
mod registry_ops;

fn corpus_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/registry_path")
}

#[test]
fn registry_path_corpus() {
    let dir = corpus_dir();
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    assert!(!files.is_empty(), "empty corpus {}", dir.display());
    for f in &files {
        let data = std::fs::read(f).unwrap();
        if std::panic::catch_unwind(|| registry_ops::run(&data)).is_err() {
            panic!("corpus input {} violates the property", f.display());
        }
    }
    eprintln!("registry_path: {} inputs", files.len());
}

#[test]
fn seeds_pass() {
    for s in seeds() {
        registry_ops::run(&s);
    }
}

#[test]
#[ignore = "writes fuzz/corpus/registry_path/seed-*; run by hand"]
fn regenerate_seeds() {
    let dir = corpus_dir();
    std::fs::create_dir_all(&dir).unwrap();
    for (i, s) in seeds().iter().enumerate() {
        std::fs::write(dir.join(format!("seed-{i:02}")), s).unwrap();
    }
}

// --- A tiny assembler for the byte programs registry_ops::run interprets. ---
// Keep in step with fuzz/src/registry_ops.rs.

const WRITE: u8 = 0;
const READ: u8 = 2;
const DELETE: u8 = 3;
const LIST: u8 = 4;
const TXN: u8 = 5;
const WATCH: u8 = 7;
const UNWATCH: u8 = 8;
const USAGE: u8 = 9;

/// Valid components by index into registry_ops' table:
/// a b ab a+x a- a. a0 c x.y 0 Z @ = : _ ..a
fn p(components: &[u8]) -> Vec<u8> {
    let mut out = vec![4, components.len() as u8];
    out.extend(components.iter().map(|c| c * 8));
    out
}
/// A path with one invalid component (`..`) after the given valid ones.
fn bad(components: &[u8]) -> Vec<u8> {
    let mut out = vec![4, components.len() as u8 + 1];
    out.extend(components.iter().map(|c| c * 8));
    out.push(7 + 8 * 2); // ".."
    out
}
fn root() -> Vec<u8> {
    vec![4, 0]
}
fn long_path(valid: bool) -> Vec<u8> {
    vec![1, if valid { 0 } else { 1 }]
}
fn raw(s: &[u8]) -> Vec<u8> {
    let mut out = vec![0, s.len() as u8];
    out.extend_from_slice(s);
    out
}
fn val(v: &[u8]) -> Vec<u8> {
    let mut out = vec![v.len() as u8];
    out.extend_from_slice(v);
    out
}
fn cat(parts: &[&[u8]]) -> Vec<u8> {
    parts.concat()
}

fn seeds() -> Vec<Vec<u8>> {
    let (a, b, ab, ax, am, ad, a0, c) = (0, 1, 2, 3, 4, 5, 6, 7);
    vec![
        // Writes around the '/' sibling boundary, then list and usage.
        cat(&[
            &[WRITE], &p(&[a]), &val(b"1"),
            &[WRITE], &p(&[a, b]), &val(b"22"),
            &[WRITE], &p(&[ab]), &val(b"3"),
            &[WRITE], &p(&[ax, c]), &val(b""),
            &[WRITE], &p(&[am]), &val(b"x"),
            &[WRITE], &p(&[ad, b, c]), &val(b"y"),
            &[WRITE], &p(&[a0]), &val(b"z"),
            &[LIST], &root(), &[LIST], &p(&[a]), &[LIST], &p(&[ad]),
            &[USAGE], &p(&[a]), &[USAGE], &root(),
        ]),
        // Watches by two owners, writes and a subtree delete.
        cat(&[
            &[WATCH, 0, 1], &p(&[a]),
            &[WATCH, 1, 2], &root(),
            &[WATCH, 1, 3], &p(&[a, b]),
            &[WRITE], &p(&[a, b, c]), &val(b"v"),
            &[WRITE], &p(&[ab]), &val(b"w"),
            &[DELETE], &p(&[a]),
            &[UNWATCH, 1, 1, 2],
            &[UNWATCH, 0, 0],
            &[WRITE], &p(&[a]), &val(b"again"),
        ]),
        // Transactions: committed, failed check, read-your-writes.
        cat(&[
            &[WRITE], &p(&[c]), &val(b"1"),
            &[TXN, 4, 4], &p(&[c]), &val(b"1"),
            &[0], &p(&[a]), &val(b"lock"),
            &[2], &p(&[a]),
            &[1], &p(&[c]),
            &[TXN, 2, 3], &p(&[a]),
            &[0], &p(&[b]), &val(b"never"),
            &[READ], &p(&[b]),
        ]),
        // Rejected ops: bad paths, oversized values, a bad op inside a txn.
        cat(&[
            &[WRITE], &p(&[a]), &val(b"keep"),
            &[WRITE], &bad(&[a]), &val(b"no"),
            &[WRITE], &p(&[b]), &[255],
            &[WRITE], &long_path(true), &val(b"max"),
            &[WRITE], &long_path(false), &val(b"over"),
            &[DELETE], &raw(b"a/b"),
            &[DELETE], &raw(b"/a/"),
            &[DELETE], &raw(b"/a//b"),
            &[LIST], &raw(b"/a b"),
            &[TXN, 2, 0], &p(&[c]), &val(b"1"), &[1], &bad(&[]),
            &[WATCH, 0, 0], &raw(b""),
            &[USAGE], &raw(b"/\xc3\xa9"),
            &[DELETE], &root(),
        ]),
    ]
}
