//! Replays the `resume` fuzz corpus (fuzz/corpus/resume) through the same
//! check the fuzz target runs (fuzz/src/resume_check.rs), on stable, as part
//! of `cargo test`.
//!
//! `cargo test -p fido-broker --test resume_corpus -- --ignored regenerate_seeds`
//! rewrites the hand-written seed files (`seed-*`).

use std::path::{Path, PathBuf};

#[path = "../../../fuzz/src/resume_check.rs"]
mod resume_check;

fn corpus_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/resume")
}

#[test]
fn resume_corpus_replays_cleanly() {
    let mut n = 0;
    for entry in std::fs::read_dir(corpus_dir()).unwrap() {
        let path = entry.unwrap().path();
        let data = std::fs::read(&path).unwrap();
        std::panic::catch_unwind(|| resume_check::check(&data))
            .unwrap_or_else(|_| panic!("corpus input {} violates the property", path.display()));
        n += 1;
    }
    assert!(
        n >= seeds().len(),
        "corpus missing at {}",
        corpus_dir().display()
    );
}

/// Hand-written inputs (see `resume_from` for the byte layout: uid choice,
/// domain, slot, secret choice, then each list's count and items).
fn seeds() -> Vec<Vec<u8>> {
    vec![
        // uid 1000 resumes domain 1 in slot 0 with its secret; claims its
        // recorded mapping (slot 1 of 2), connection 10 with peer 2 (s0),
        // and connection 12 with the wrong peer.
        vec![0, 1, 0, 0, 1, 0, 1, 1, 2, 2, 2, 2, 0, 4, 2, 0, 1, 7],
        // The same from uid 2000: denied.
        vec![1, 1, 0, 0, 0, 1, 1, 2, 1, 2, 2, 0, 0],
        // Domain 1 with domain 2's secret: denied.
        vec![0, 1, 0, 1, 2, 0, 0, 0, 0],
        // Domain 1's secret with one bit off: denied.
        vec![0, 1, 0, 2, 77, 0, 0, 0, 0],
        // Domain 1 in domain 2's slot: denied.
        vec![0, 1, 1, 0, 0, 0, 0, 0],
        // A domain nobody recorded: denied.
        vec![0, 6, 0, 0, 0, 0, 0, 0],
        // Proven, but 512 connections: over the quota.
        vec![0, 1, 0, 0, 0, 0, 0xe1],
        // Proven (uid 2000, domain 3), duplicate services, claims on and off record.
        vec![
            1, 3, 2, 0, 6, 0, 0, 1, 1, 2, 2, 2, 3, 4, 2, 3, 3, 1, 4, 2, 0, 2, 1, 5, 4, 2, 4, 2, 1,
            4, 1,
        ],
    ]
}

/// The seeds reach the outcomes their comments say.
#[test]
fn seeds_reach_each_outcome() {
    use fido_broker::resume::check_resume;
    use fido_proto::ErrorCode;
    let world = resume_check::world();
    let outcome = |seed: &[u8]| {
        let (uid, r) = resume_check::resume_from(seed);
        check_resume(&world, uid, &r, &resume_check::LIMITS)
    };
    let seeds = seeds();
    let ok = outcome(&seeds[0]).unwrap();
    assert_eq!(ok.mapped, vec![(1, 2)]);
    assert_eq!(ok.connections.len(), 1);
    assert_eq!(ok.connections[0].0, 10);
    assert_eq!(ok.unrecorded_connections, vec![(12, 2)]);
    for s in &seeds[1..6] {
        assert_eq!(outcome(s).unwrap_err().code, ErrorCode::Denied, "{s:?}");
    }
    assert_eq!(outcome(&seeds[6]).unwrap_err().code, ErrorCode::Quota);
    let ok = outcome(&seeds[7]).unwrap();
    assert_eq!(ok.services.len(), 3);
    assert!(
        !ok.mapped.is_empty() && !ok.unrecorded_mappings.is_empty(),
        "{ok:?}"
    );
    assert_eq!(ok.connections.len(), 1, "{ok:?}");
    assert_eq!(ok.unrecorded_connections.len(), 2, "{ok:?}");
}

#[test]
#[ignore = "writes fuzz/corpus/resume/seed-*; run by hand"]
fn regenerate_seeds() {
    let dir = corpus_dir();
    std::fs::create_dir_all(&dir).unwrap();
    for (i, s) in seeds().iter().enumerate() {
        std::fs::write(dir.join(format!("seed-{i:02}")), s).unwrap();
    }
}
