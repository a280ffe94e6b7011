//! `fido-bench pipe --quick` on small filters: the JSON records, every
//! strategy measured, and the weight experiment's shares and plot.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const FIDO: &str = env!("CARGO_BIN_EXE_fido-bench");

/// Whether this build has the pipe engine (`__pipe-app serve --strategy fido`
/// starts instead of saying the engine is not available).
fn engine_built() -> bool {
    let out = Command::new(FIDO)
        .args([
            "__pipe-app",
            "serve",
            "/nonexistent-dir",
            "--port",
            "0",
            "--strategy",
            "fido",
        ])
        .env("FIDO_BROKER", "/nonexistent/broker.sock")
        .output()
        .unwrap();
    !String::from_utf8_lossy(&out.stderr).contains("not available in this build")
}

#[test]
fn bench_pipe_quick_writes_records() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("pipe.json");
    let png = dir.path().join("fair.png");
    let t = Instant::now();
    let out = Command::new(FIDO)
        .args([
            "pipe",
            "--quick",
            "--filter",
            "file-to-file-busy1",
            "--json",
        ])
        .arg(&json)
        .arg("--plot")
        .arg(&png)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        t.elapsed() < Duration::from_secs(60),
        "took {:?}",
        t.elapsed()
    );
    let text = std::fs::read_to_string(&json).unwrap();
    let mut systems = Vec::new();
    for line in text.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        for k in [
            "suite", "case", "system", "metric", "value", "unit", "p50", "p99", "n",
        ] {
            assert!(v.get(k).is_some(), "field {k} missing in {line}");
        }
        assert_eq!(v["suite"], "pipe");
        assert_eq!(v["case"], "file-to-file-busy1");
        let val = v["value"].as_f64().unwrap();
        assert!(val.is_finite() && val >= 0.0, "{line}");
        if v["metric"] == "bytes_per_s" {
            assert!(val > 0.0, "{line}");
            assert_eq!(v["n"], 32u64 << 20, "{line}");
            systems.push(v["system"].as_str().unwrap().to_string());
        }
    }
    let mut want = vec!["readwrite".to_string(), "sendfile".to_string()];
    if engine_built() {
        want.push("fido-pipe".into());
    }
    systems.sort();
    want.sort();
    assert_eq!(systems, want);
}

#[test]
fn bench_pipe_quick_fairness_plot() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("pipe.json");
    let png = dir.path().join("fair.png");
    let out = Command::new(FIDO)
        .args(["pipe", "--quick", "--filter", "fairness", "--json"])
        .arg(&json)
        .arg("--plot")
        .arg(&png)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let text = std::fs::read_to_string(&json).unwrap();
    let recs: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let shares: Vec<f64> = recs
        .iter()
        .filter(|v| v["metric"] == "share" && v["system"] == "sendfile")
        .map(|v| v["value"].as_f64().unwrap())
        .collect();
    assert_eq!(shares.len(), 3);
    assert!((shares.iter().sum::<f64>() - 1.0).abs() < 1e-9);
    assert!(recs.iter().any(|v| v["metric"] == "jain_weighted"));
    let png = std::fs::read(&png).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
}
