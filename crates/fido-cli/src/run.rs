//! `fido run [--no-accel] -- CMD ARGS…`: runs an unmodified program with the
//! MMNet library (`libfido_net.so`) preloaded, so its TCP connections to
//! co-located programs also under `fido run` move onto Fido rings. The
//! environment carries the preload and the broker socket to every child and
//! across `exec`.

use anyhow::{bail, Context as _};
use std::ffi::OsString;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};

/// Where the library is looked for, in order: `$FIDO_NET_LIB`, next to this
/// executable (a cargo target dir), `../lib/fido/` relative to it (an install
/// prefix), `/usr/local/lib/fido/`, `/usr/lib/fido/`.
pub fn find_library() -> anyhow::Result<PathBuf> {
    if let Some(p) = std::env::var_os("FIDO_NET_LIB") {
        let p = PathBuf::from(p);
        if p.is_file() {
            return Ok(p);
        }
        bail!("FIDO_NET_LIB={} is not a file", p.display());
    }
    let mut cands = Vec::new();
    if let Ok(exe) = std::env::current_exe() {
        if let Some(dir) = exe.parent() {
            cands.push(dir.join("libfido_net.so"));
            cands.push(dir.join("../lib/fido/libfido_net.so"));
        }
    }
    cands.push(PathBuf::from("/usr/local/lib/fido/libfido_net.so"));
    cands.push(PathBuf::from("/usr/lib/fido/libfido_net.so"));
    for c in &cands {
        if c.is_file() {
            return Ok(c.canonicalize().unwrap_or_else(|_| c.clone()));
        }
    }
    bail!(
        "libfido_net.so not found (looked in {}); build it with `cargo build -p fido-net` or set FIDO_NET_LIB",
        cands.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
    )
}

/// Replaces this process with `cmd` (returns only on failure).
pub fn run(no_accel: bool, socket: Option<PathBuf>, cmd: Vec<OsString>) -> anyhow::Result<bool> {
    let Some((prog, args)) = cmd.split_first() else {
        bail!("fido run: no command given (fido run -- CMD ARGS…)")
    };
    let mut c = std::process::Command::new(prog);
    c.args(args);
    if no_accel {
        c.env("FIDO_NET", "off");
    } else {
        let lib = find_library()?;
        let broker = socket.unwrap_or_else(fido::default_broker_path);
        if !Path::new(&broker).exists() {
            eprintln!(
                "fido run: no broker socket at {} — connections stay plain TCP (start `fido broker`)",
                broker.display()
            );
        }
        let mut preload = OsString::from(lib.as_os_str());
        if let Some(old) = std::env::var_os("LD_PRELOAD").filter(|o| !o.is_empty()) {
            preload.push(":");
            preload.push(old);
        }
        c.env("LD_PRELOAD", preload)
            .env("FIDO_BROKER", &broker)
            .env_remove("FIDO_NET");
    }
    let err = c.exec();
    Err(err).with_context(|| format!("running {}", Path::new(prog).display()))
}
