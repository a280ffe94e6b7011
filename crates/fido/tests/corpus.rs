//! Replays the `descriptor` fuzz corpus (fuzz/corpus/descriptor) through the
//! same check the fuzz target runs, on stable, as part of `cargo test`.

#[test]
fn descriptor_corpus_replays_cleanly() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/descriptor");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let data = std::fs::read(entry.unwrap().path()).unwrap();
        fido::validate::fuzz_descriptor(&data);
        n += 1;
    }
    assert!(n >= 5, "corpus missing at {}", dir.display());
}
