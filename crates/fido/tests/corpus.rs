//! Replays the `descriptor` fuzz corpus (fuzz/corpus/descriptor) through the
//! same check the fuzz target runs (fuzz/src/descriptor.rs), on stable, as
//! part of `cargo test`.

#[path = "../../../fuzz/src/descriptor.rs"]
mod descriptor;

#[test]
fn descriptor_corpus_replays_cleanly() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/descriptor");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let data = std::fs::read(entry.unwrap().path()).unwrap();
        descriptor::check(&data);
        n += 1;
    }
    assert!(n >= 5, "corpus missing at {}", dir.display());
}

/// A good descriptor (one segment of 16 bytes at the arena's start) goes
/// through the fuzz check's accepted path.
#[test]
fn a_good_descriptor_passes_the_fuzz_check() {
    const B: u64 = 1 << 40;
    let words: [u64; 8] = [1, 2, 16, 1 << 32, B, 16, 0, 0];
    let mut input: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    input.extend([0u64; 4].iter().flat_map(|w| w.to_le_bytes()));
    descriptor::check(&input);
}
