//! The product stands alone: the `fido` binary's normal dependency tree
//! contains none of the benchmark baselines (they live in `bench/`, the
//! `fido-bench` binary) and nothing that needs an external compiler to build.

use std::collections::BTreeSet;
use std::process::Command;

/// Crates of the benchmark baselines and their plots; any of them under
/// fido-cli means the product links its benchmarks again.
const BASELINES: [&str; 12] = [
    "tonic",
    "tonic-prost",
    "prost",
    "capnp",
    "capnp-rpc",
    "tarpc",
    "iceoryx2",
    "plotters",
    "dejavu",
    "hyper",
    "tower",
    "fido-bench",
];

#[test]
fn fido_binary_depends_on_no_benchmark_baseline() {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let manifest = concat!(env!("CARGO_MANIFEST_DIR"), "/../../Cargo.toml");
    let out = Command::new(cargo)
        .args(["tree", "--offline", "--locked", "-p", "fido-cli", "-e", "normal", "--prefix", "none"])
        .arg("--manifest-path")
        .arg(manifest)
        .output()
        .expect("running cargo tree");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "cargo tree failed: {}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    // One crate per line: `name vX.Y.Z [(path)] [(*)]`.
    let crates: BTreeSet<&str> = stdout.lines().filter_map(|l| l.split_whitespace().next()).collect();
    assert!(crates.contains("fido-cli") && crates.contains("fido"), "unexpected cargo tree output:\n{stdout}");
    let found: Vec<&str> = BASELINES.iter().copied().filter(|b| crates.contains(b)).collect();
    assert!(
        found.is_empty(),
        "the fido binary depends on benchmark crates {found:?} ({} crates in its tree)",
        crates.len()
    );
}
