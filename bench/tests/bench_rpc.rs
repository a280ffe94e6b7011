//! `fido-bench rpc --quick` end to end, on a filter small enough for CI: the JSON
//! lines are well formed, every system ran beside fido, every sequence call's
//! checksum was asserted, the plot is a PNG, nothing is left behind, the
//! floors (`futex-floor`, `eventfd-floor`, `shm-floor`) ran beside them and the
//! goal lines are printed — and a server returning a wrong checksum fails the
//! run (`shm-floor` too).

use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use fido_test_support::wait::run_limited;

const FIDO: &str = env!("CARGO_BIN_EXE_fido-bench");
const SYSTEMS: [&str; 6] = ["fido", "uds", "tarpc", "capnp", "tonic", "xmlrpc"];
/// Measured beside the systems: null-notified's blocking floors.
const NULL_FLOORS: [&str; 2] = ["futex-floor", "eventfd-floor"];
/// Measured beside the systems on every sequence case, checksums asserted.
const SEQ_FLOOR: &str = "shm-floor";

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn python_ok() -> bool {
    Command::new("python3")
        .args(["-c", "import xmlrpc.server"])
        .status()
        .is_ok_and(|s| s.success())
}

fn bench(dir: &Path, filter: &str, extra: &[&str], env: &[(&str, &str)]) -> Output {
    let tmp = dir.join("tmp");
    std::fs::create_dir_all(&tmp).unwrap();
    let mut cmd = Command::new(FIDO);
    cmd.args(["rpc", "--quick", "--filter", filter])
        .args(extra)
        .env("TMPDIR", &tmp)
        .env_remove("RUST_LOG");
    for (k, v) in env {
        cmd.env(k, v);
    }
    run_limited(&mut cmd, Duration::from_secs(120)).0
}

fn left_in(tmp: &Path) -> Vec<String> {
    std::fs::read_dir(tmp)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("fido-bench"))
        .collect()
}

#[test]
fn rpc_quick_json_is_well_formed_and_checked() {
    assert!(
        python_ok(),
        "python3 with xmlrpc is needed (Debian package python3)"
    );
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("rpc.json");
    let png = dir.path().join("rpc.png");
    let out = bench(
        dir.path(),
        "null-notified,byteseq-send-100$,varseq-recv-100$",
        &[
            "--json",
            json.to_str().unwrap(),
            "--plot",
            png.to_str().unwrap(),
        ],
        &[],
    );
    let stdout = text(&out.stdout);
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");

    let body = std::fs::read_to_string(&json).unwrap();
    let mut seen: Vec<(String, String, String)> = Vec::new();
    let mut seq_calls = 0u64;
    for line in body.lines() {
        let v: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("bad JSON line {line}: {e}"));
        let o = v.as_object().unwrap();
        for k in [
            "suite", "case", "system", "metric", "value", "unit", "p50", "p99", "n",
        ] {
            assert!(o.contains_key(k), "field {k} missing in {line}");
        }
        assert_eq!(o.len(), 10, "extra fields in {line}");
        // Where it ran (bench/src/machine.rs): CPU, cores, placement, virtualization, kernel.
        let m = &v["machine"];
        for k in ["cpu", "cpus", "cpus_allowed", "placement", "virt", "kernel"] {
            assert!(!m[k].is_null(), "machine.{k} missing in {line}");
        }
        assert!(m["cpus"].as_u64().unwrap() >= 1, "{line}");
        assert_eq!(v["suite"], "rpc");
        let (case, system, metric) = (
            v["case"].as_str().unwrap().to_string(),
            v["system"].as_str().unwrap().to_string(),
            v["metric"].as_str().unwrap().to_string(),
        );
        assert!(
            ["null-notified", "byteseq-send-100", "varseq-recv-100"].contains(&case.as_str()),
            "case {case} is outside the filter"
        );
        let value = v["value"].as_f64().unwrap();
        let n = v["n"].as_u64().unwrap();
        match metric.as_str() {
            "round_trip_ns" => {
                assert_eq!(case, "null-notified");
                assert_eq!(v["unit"], "ns");
                let (p50, p99) = (v["p50"].as_f64().unwrap(), v["p99"].as_f64().unwrap());
                assert!(value > 0.0 && n > 0 && p99 >= p50 && value == p50, "{line}");
            }
            "bytes_per_s" => {
                assert_eq!(v["unit"], "B/s");
                assert!(value > 0.0 && n > 0, "{line}");
                seq_calls += n;
            }
            // LEN 100 takes milliseconds even for XML-RPC: nobody may run out of budget.
            m => panic!("unexpected metric {m} in {line}"),
        }
        seen.push((system, case, metric));
    }
    let has = |sys: &str, case: &str| seen.iter().any(|(s, c, _)| s == sys && c == case);
    for sys in SYSTEMS {
        for case in ["null-notified", "byteseq-send-100", "varseq-recv-100"] {
            assert!(has(sys, case), "no {sys} {case} record in\n{body}");
        }
    }
    for f in NULL_FLOORS {
        assert!(has(f, "null-notified"), "no {f} record in\n{body}");
        assert!(
            !has(f, "byteseq-send-100"),
            "{f} ran a sequence case:\n{body}"
        );
    }
    for case in ["byteseq-send-100", "varseq-recv-100"] {
        assert!(
            has(SEQ_FLOOR, case),
            "no {SEQ_FLOOR} {case} record in\n{body}"
        );
    }
    assert!(
        !has(SEQ_FLOOR, "null-notified"),
        "{SEQ_FLOOR} ran a null case"
    );
    // The null-notified goals are printed with the blocking floor's bound (the
    // classification itself is unit-tested in fido-bench).
    let goals: Vec<&str> = stdout
        .lines()
        .filter(|l| l.contains("null-notified: fido >="))
        .collect();
    assert_eq!(goals.len(), 3, "{stdout}");
    for g in goals {
        assert!(
            ["[met]", "[NOT met]", "[beyond floor]"]
                .iter()
                .any(|v| g.contains(v))
                && g.contains("-floor is "),
            "goal line without a verdict or a floor: {g}"
        );
    }
    // Every measured sequence call (and every warm-up call) had its checksum asserted.
    let line = stdout
        .lines()
        .find(|l| l.contains("checksums asserted:"))
        .unwrap_or_else(|| panic!("no checksum summary in\n{stdout}"));
    let checked: u64 = line
        .split("asserted:")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("unparsable: {line}"));
    assert!(
        checked >= seq_calls && seq_calls > 0,
        "{checked} checksums asserted for {seq_calls} measured calls"
    );
    let png_bytes = std::fs::read(&png).unwrap();
    assert_eq!(&png_bytes[..8], b"\x89PNG\r\n\x1a\n");
    assert!(
        left_in(&dir.path().join("tmp")).is_empty(),
        "left behind in TMPDIR"
    );
}

#[test]
fn rpc_wrong_checksum_fails_the_run() {
    assert!(
        python_ok(),
        "python3 with xmlrpc is needed (Debian package python3)"
    );
    let dir = tempfile::tempdir().unwrap();
    // Every server adds one to the checksums it returns.
    let out = bench(
        dir.path(),
        "byteseq-send-100$,fixedseq-recv-100$",
        &[],
        &[("FIDO_BENCH_RPC_CORRUPT", "1")],
    );
    let stdout = text(&out.stdout);
    let stderr = text(&out.stderr);
    assert!(!out.status.success(), "a corrupted run passed:\n{stdout}");
    for sys in SYSTEMS.into_iter().chain([SEQ_FLOOR]) {
        for case in ["byteseq-send-100", "fixedseq-recv-100"] {
            assert!(
                stdout.contains(&format!("# FAILED: {sys} {case}")),
                "{sys} {case} did not fail:\n{stdout}\n{stderr}"
            );
        }
    }
    assert!(stderr.contains("checksum mismatch"), "{stderr}");
    assert!(
        left_in(&dir.path().join("tmp")).is_empty(),
        "left behind in TMPDIR"
    );
}
