//! `fido-bench channel --quick` on one case: the JSON records have the
//! docs/BENCHMARKS.md format, fido and a baseline ran in the same invocation, and the
//! embedded broker's directory is gone afterwards.

use std::process::Command;
use std::time::Duration;

use fido_test_support::wait::run_limited;

const FIDO: &str = env!("CARGO_BIN_EXE_fido-bench");

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn bench_writes_design_json_lines() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("out.json");
    let tmp = dir.path().join("tmp");
    std::fs::create_dir(&tmp).unwrap();
    let mut cmd = Command::new(FIDO);
    cmd.args([
        "channel",
        "--quick",
        "--filter",
        "latency-polled-64B",
        "--json",
    ])
    .arg(&json)
    .env("TMPDIR", &tmp)
    .env_remove("RUST_LOG");
    let out = run_limited(&mut cmd, Duration::from_secs(60)).0;
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    assert!(
        stdout.contains("latency-polled-64B") && stdout.contains("fido"),
        "{stdout}"
    );
    let body = std::fs::read_to_string(&json).unwrap();
    let mut systems = Vec::new();
    for line in body.lines() {
        let v: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("bad JSON line {line}: {e}"));
        let o = v.as_object().unwrap();
        let keys: Vec<&str> = o.keys().map(|k| k.as_str()).collect();
        for k in [
            "suite", "case", "system", "metric", "value", "unit", "p50", "p99", "n",
        ] {
            assert!(keys.contains(&k), "field {k} missing in {line}");
        }
        assert_eq!(o.len(), 10, "extra fields in {line}");
        // Where it ran (bench/src/machine.rs): CPU, cores, placement, virtualization, kernel.
        let m = &v["machine"];
        for k in ["cpu", "cpus", "cpus_allowed", "placement", "virt", "kernel"] {
            assert!(!m[k].is_null(), "machine.{k} missing in {line}");
        }
        assert!(m["cpus"].as_u64().unwrap() >= 1, "{line}");
        assert_eq!(v["suite"], "channel");
        assert_eq!(v["case"], "latency-polled-64B");
        assert!(v["value"].is_number() && v["n"].is_u64(), "{line}");
        systems.push(v["system"].as_str().unwrap().to_string());
    }
    let fido = body
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .find(|v| v["system"] == "fido");
    let fido = fido.unwrap_or_else(|| panic!("no fido record in {body}"));
    assert_eq!(fido["metric"], "one_way_ns");
    assert_eq!(fido["unit"], "ns");
    assert!(fido["value"].as_f64().unwrap() > 0.0 && fido["n"].as_u64().unwrap() > 0);
    assert!(fido["p99"].as_f64().unwrap() >= fido["p50"].as_f64().unwrap());
    assert!(
        systems.iter().any(|s| s != "fido"),
        "no baseline ran beside fido: {systems:?}"
    );
    // The embedded broker's directory is gone.
    let left: Vec<_> = std::fs::read_dir(&tmp)
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert!(
        left.iter()
            .all(|n| !n.to_string_lossy().starts_with("fido-bench-")),
        "left behind: {left:?}"
    );
}
