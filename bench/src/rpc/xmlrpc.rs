//! `xmlrpc`: XML-RPC as most people meet it — Python's standard
//! `xmlrpc.server.SimpleXMLRPCDispatcher` and `xmlrpc.client.ServerProxy`
//! (Debian's python3), HTTP/1.1 keep-alive over a Unix stream socket. Both the
//! server and the client are Python processes (`xmlrpc_peer.py`, embedded in
//! this binary and written next to the point's socket); the client runs the same
//! warm-up / measured-window loop as the Rust clients and prints the same JSON.

use std::path::{Path, PathBuf};
use std::process::Command;

use super::{Case, RpcSystem, Timing};

/// The peer script.
pub const SCRIPT: &str = include_str!("xmlrpc_peer.py");

/// The Python interpreter (`FIDO_BENCH_PYTHON` overrides `python3`).
pub fn python() -> String {
    std::env::var("FIDO_BENCH_PYTHON").unwrap_or_else(|_| "python3".into())
}

/// Whether a Python with `xmlrpc` runs here.
pub fn available() -> bool {
    Command::new(python())
        .args(["-c", "import xmlrpc.server, xmlrpc.client"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

pub struct XmlRpc;

/// Writes the script next to `addr` (once per directory) and returns its path.
fn script(addr: &str) -> PathBuf {
    let dir = Path::new(addr).parent().unwrap_or(Path::new("."));
    let p = dir.join("xmlrpc_peer.py");
    if !p.exists() {
        // A failure shows up as the server not starting, with Python's message.
        let _ = std::fs::write(&p, SCRIPT);
    }
    p
}

impl RpcSystem for XmlRpc {
    fn name(&self) -> &str {
        "xmlrpc"
    }
    fn supports(&self, case: &Case) -> bool {
        // No busy-polling mode, and the case study is fido against tonic only.
        matches!(case, Case::NullNotified | Case::NullAdaptive | Case::Seq { .. })
    }
    fn server(&self, addr: &str, _case: &Case, cpu: usize) -> Command {
        let mut c = Command::new(python());
        c.arg(script(addr)).args(["server", addr, &cpu.to_string()]);
        c
    }
    fn client(&self, addr: &str, case: &Case, cpu: usize, t: Timing) -> Command {
        let mut c = Command::new(python());
        c.arg(script(addr)).args([
            "client",
            addr,
            &cpu.to_string(),
            &case.name(),
            &t.warmup.as_millis().to_string(),
            &t.duration.as_millis().to_string(),
        ]);
        c
    }
}
