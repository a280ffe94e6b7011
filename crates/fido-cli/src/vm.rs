//! `fido vm`: start, list and stop VM domains (docs/VM.md).
//!
//! `fido vm run` is the VM's supervisor: it runs in the foreground for the
//! VM's life (QEMU is its child and dies with it) and keeps a record of
//! itself in the caller's VM directory, which `list` reads and `stop` uses.
//! The record is locked while the VM runs, so a name serves one VM at a time
//! and a record whose lock is free is stale.

use anyhow::{anyhow, bail, Context};
use clap::{Args, Subcommand};
use fido_vm::qemu::{self, Accel, NicSpec, VmSpec};
use fido_vm::supervisor::{Ended, Supervisor};
use serde_json::json;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

#[derive(Subcommand)]
pub enum VmCmd {
    /// Start a VM domain and supervise it in the foreground (Ctrl-C stops it).
    Run(Box<RunArgs>),
    /// List the VM domains you started.
    List {
        /// Print JSON lines instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Stop a VM domain you started.
    Stop {
        name: String,
        /// Seconds to wait for it to go.
        #[arg(long, default_value_t = 20)]
        timeout: u64,
    },
}

#[derive(Args)]
pub struct RunArgs {
    /// The VM's name: its identity (the label of its domains) and its record.
    pub name: String,
    /// Kernel to boot (bzImage or an uncompressed vmlinux).
    #[arg(long)]
    pub kernel: PathBuf,
    #[arg(long, conflicts_with = "disk")]
    pub initrd: Option<PathBuf>,
    /// A disk image (raw or qcow2) as the root device.
    #[arg(long)]
    pub disk: Option<PathBuf>,
    /// Kernel command line (`intel_iommu=on` is added: the guest's doorbells need it;
    /// `no_timer_check`: a loaded TCG host can fail the kernel's early timer check).
    #[arg(long, default_value = "console=ttyS0 panic=-1 quiet no_timer_check")]
    pub append: String,
    /// Guest memory in MiB.
    #[arg(long, default_value_t = 256)]
    pub mem: u32,
    #[arg(long, default_value_t = 1)]
    pub cpus: u16,
    /// The VM's arena, shared read-only with its peers (a power of two: 64M, 1G).
    #[arg(long, default_value = "64M", value_parser = parse_size)]
    pub arena: u64,
    /// Hot-plug ports: how many peer arenas the VM can map at once.
    #[arg(long, default_value_t = 8)]
    pub ports: u16,
    /// Largest peer arena a port takes (a power of two).
    #[arg(long, default_value = "1G", value_parser = parse_size)]
    pub max_peer_arena: u64,
    /// Doorbell vectors (two per connection; vector 0 is reserved).
    #[arg(long, default_value_t = 64)]
    pub vectors: u16,
    /// Serial console on a Unix socket at this path (a server; connect with socat).
    #[arg(long)]
    pub console: Option<PathBuf>,
    /// auto (KVM when it can boot a guest, else TCG), kvm or tcg.
    #[arg(long, default_value = "auto")]
    pub accel: String,
    /// Broker socket [default: $FIDO_BROKER, $XDG_RUNTIME_DIR/fido/broker.sock, /run/fido/broker.sock]
    #[arg(long)]
    pub socket: Option<PathBuf>,
    /// A virtio-net card on QEMU's user-mode network: `user` or
    /// `user:HOST-GUEST[,HOST-GUEST…]` (TCP from 127.0.0.1:HOST to the guest's
    /// port GUEST). For the TCP baselines of `fido demo --vm`.
    #[arg(long, hide = true, value_parser = parse_nic)]
    pub nic: Option<NicSpec>,
    /// Further QEMU arguments (after `--`).
    #[arg(last = true)]
    pub qemu_args: Vec<String>,
}

fn parse_nic(s: &str) -> Result<NicSpec, String> {
    let forwards = match s.strip_prefix("user") {
        Some("") => "",
        Some(rest) => rest.strip_prefix(':').ok_or_else(|| format!("--nic {s:?}: use user or user:HOST-GUEST,..."))?,
        None => return Err(format!("--nic {s:?}: only user networking is offered (user or user:HOST-GUEST,...)")),
    };
    let mut hostfwd = Vec::new();
    for pair in forwards.split(',').filter(|p| !p.is_empty()) {
        let (h, g) = pair.split_once('-').ok_or_else(|| format!("--nic: {pair:?} is not HOST-GUEST"))?;
        let port = |p: &str| p.parse::<u16>().ok().filter(|&p| p != 0).ok_or_else(|| format!("--nic: {p:?} is not a port"));
        hostfwd.push((port(h)?, port(g)?));
    }
    Ok(NicSpec::User { hostfwd })
}

pub(crate) fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let (num, mult) = match s.char_indices().find(|(_, c)| c.is_ascii_alphabetic()) {
        Some((i, _)) => {
            let m = match s[i..].to_ascii_uppercase().trim_end_matches("IB").trim_end_matches('B') {
                "" => 1,
                "K" => 1 << 10,
                "M" => 1 << 20,
                "G" => 1 << 30,
                other => return Err(format!("unknown size unit {other:?}")),
            };
            (&s[..i], m)
        }
        None => (s, 1),
    };
    let n: u64 = num.trim().parse().map_err(|e| format!("{s:?}: {e}"))?;
    n.checked_mul(mult).ok_or_else(|| format!("{s:?} is too large"))
}

/// Where the caller's VM records live: private to the caller.
pub fn vm_dir() -> anyhow::Result<PathBuf> {
    let uid = rustix::process::getuid().as_raw();
    let dir = match std::env::var_os("XDG_RUNTIME_DIR").filter(|d| !d.is_empty()) {
        Some(d) => PathBuf::from(d).join("fido/vm"),
        None if uid == 0 => PathBuf::from("/run/fido/vm"),
        None => std::env::temp_dir().join(format!("fido-vm-{uid}")),
    };
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let meta = std::fs::symlink_metadata(&dir)?;
    if !meta.is_dir() || meta.uid() != uid || meta.mode() & 0o077 != 0 {
        bail!("{} is not a private directory of yours (owner {}, mode {:o}): refusing to use it", dir.display(), meta.uid(), meta.mode() & 0o777);
    }
    Ok(dir)
}

fn check_name(name: &str) -> anyhow::Result<()> {
    if name.is_empty() || name.len() > 64 || !name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.')) || name.starts_with('.') {
        bail!("VM name {name:?}: use 1–64 letters, digits, '-', '_' or '.' (not first)");
    }
    Ok(())
}

/// The record of a running VM, locked for its life.
struct Record {
    path: PathBuf,
    _lock: File,
}

impl Record {
    fn claim(dir: &Path, name: &str) -> anyhow::Result<Record> {
        let lock_path = dir.join(format!("{name}.lock"));
        let lock = OpenOptions::new().create(true).truncate(false).write(true).mode(0o600).open(&lock_path)?;
        if rustix::fs::flock(&lock, rustix::fs::FlockOperation::NonBlockingLockExclusive).is_err() {
            bail!("a VM named {name:?} is already running (see `fido vm list`)");
        }
        Ok(Record { path: dir.join(format!("{name}.json")), _lock: lock })
    }

    fn write(&self, value: &serde_json::Value) -> anyhow::Result<()> {
        let tmp = self.path.with_extension("json.tmp");
        let mut f = OpenOptions::new().create(true).truncate(true).write(true).mode(0o600).open(&tmp)?;
        f.write_all(value.to_string().as_bytes())?;
        std::fs::rename(&tmp, &self.path)?;
        Ok(())
    }
}

impl Drop for Record {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

fn is_running(dir: &Path, name: &str) -> bool {
    match File::open(dir.join(format!("{name}.lock"))) {
        Ok(f) => match rustix::fs::flock(&f, rustix::fs::FlockOperation::NonBlockingLockShared) {
            Ok(()) => false,
            Err(_) => true,
        },
        Err(_) => false,
    }
}

pub fn run(cmd: VmCmd) -> anyhow::Result<bool> {
    match cmd {
        VmCmd::Run(args) => run_vm(*args),
        VmCmd::List { json } => list(json).map(|_| true),
        VmCmd::Stop { name, timeout } => stop(&name, Duration::from_secs(timeout)).map(|_| true),
    }
}

fn run_vm(a: RunArgs) -> anyhow::Result<bool> {
    if std::env::var_os(fido_demo::proc::PARENT_ENV).is_some() {
        // Started by `fido demo --vm`: die with it (QEMU then dies with us).
        fido_demo::proc::child_prologue()?;
    }
    check_name(&a.name)?;
    let requested = match a.accel.as_str() {
        "auto" => None,
        "kvm" => Some(Accel::Kvm),
        "tcg" => Some(Accel::Tcg),
        other => bail!("--accel {other:?}: use auto, kvm or tcg"),
    };
    let (accel, why) = qemu::choose_accel(requested);
    let dir = vm_dir()?;
    let record = Record::claim(&dir, &a.name)?;
    let mut spec = VmSpec::new(&a.name, accel);
    spec.kernel = Some(a.kernel);
    spec.initrd = a.initrd;
    spec.disk = a.disk;
    spec.append = if a.append.split_whitespace().any(|w| w.starts_with("intel_iommu=")) { a.append } else { format!("{} intel_iommu=on", a.append) };
    spec.mem_mib = a.mem;
    spec.cpus = a.cpus;
    spec.arena_len = a.arena;
    spec.ports = a.ports;
    spec.max_peer_arena = a.max_peer_arena;
    spec.vectors = a.vectors;
    spec.serial = a.console;
    spec.nic = a.nic;
    spec.extra = a.qemu_args;
    let broker = a.socket.unwrap_or_else(fido_proto::default_broker_path);
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, stop.clone())?;
    }
    eprintln!("fido vm: {}: {why}", a.name);
    let started = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let t0 = Instant::now();
    let mut sup = Supervisor::start(spec.clone(), broker.clone(), stop).map_err(|e| anyhow!("{}: {e}", a.name))?;
    let info = json!({
        "name": a.name, "pid": std::process::id(), "qemu_pid": sup.qemu_pid(),
        "uid": rustix::process::getuid().as_raw(), "accel": format!("{accel:?}").to_lowercase(),
        "arena": spec.arena_len, "mem_mib": spec.mem_mib, "cpus": spec.cpus,
        "broker": broker.display().to_string(), "started": started,
    });
    record.write(&info)?;
    let record = std::rc::Rc::new(record);
    let (rec, base) = (record.clone(), info.clone());
    sup.set_reporter(move |s| {
        let mut v = base.clone();
        v["relay"] = json!({
            "guest_frames": s.guest_frames, "heartbeats": s.heartbeats, "counters": s.counters,
            "broker_frames": s.broker_frames, "plugs": s.plugs, "unplugs": s.unplugs, "refused": s.refused,
        });
        if let Err(e) = rec.write(&v) {
            tracing::warn!("updating the VM record: {e}");
        }
    });
    eprintln!("fido vm: {}: QEMU {} running ({:.1} s to start); stop with `fido vm stop {}`", a.name, sup.qemu_pid(), t0.elapsed().as_secs_f64(), a.name);
    let ended = sup.run().map_err(|e| anyhow!("{}: {e}", a.name))?;
    let s = sup.stats();
    eprintln!(
        "fido vm: {}: {} (link: {} frames from the guest, {} from the broker, {} plugs, {} unplugs, {} refused)",
        a.name,
        match &ended {
            Ended::QemuExited(st) => format!("QEMU exited ({st})"),
            Ended::Stopped(_) => "stopped".to_string(),
            Ended::LinkBroken(why) => format!("stopped: the guest broke its link ({why})"),
        },
        s.guest_frames,
        s.broker_frames,
        s.plugs,
        s.unplugs,
        s.refused
    );
    Ok(match ended {
        Ended::QemuExited(st) => st.success(),
        Ended::Stopped(_) => true,
        Ended::LinkBroken(_) => false,
    })
}

fn records(dir: &Path) -> anyhow::Result<Vec<serde_json::Value>> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir)? {
        let p = e?.path();
        if p.extension().and_then(|x| x.to_str()) != Some("json") {
            continue;
        }
        let Some(name) = p.file_stem().and_then(|s| s.to_str()).map(str::to_string) else { continue };
        if !is_running(dir, &name) {
            let _ = std::fs::remove_file(&p);
            continue;
        }
        if let Ok(v) = std::fs::read_to_string(&p).map_err(anyhow::Error::from).and_then(|s| Ok(serde_json::from_str::<serde_json::Value>(&s)?)) {
            out.push(v);
        }
    }
    out.sort_by(|a, b| a["name"].as_str().cmp(&b["name"].as_str()));
    Ok(out)
}

fn list(json_out: bool) -> anyhow::Result<()> {
    let dir = vm_dir()?;
    let now = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let recs = records(&dir)?;
    if json_out {
        for r in &recs {
            println!("{r}");
        }
        return Ok(());
    }
    if recs.is_empty() {
        println!("no VM domains running (records in {})", dir.display());
        return Ok(());
    }
    println!("{:<20} {:>8} {:>8} {:<5} {:>8} {:>6} {:>8}", "NAME", "PID", "QEMU", "ACCEL", "ARENA", "MEM", "UP");
    for r in recs {
        println!(
            "{:<20} {:>8} {:>8} {:<5} {:>7}M {:>5}M {:>7}s",
            r["name"].as_str().unwrap_or("?"),
            r["pid"],
            r["qemu_pid"],
            r["accel"].as_str().unwrap_or("?"),
            r["arena"].as_u64().unwrap_or(0) >> 20,
            r["mem_mib"],
            now.saturating_sub(r["started"].as_u64().unwrap_or(now))
        );
    }
    Ok(())
}

fn stop(name: &str, timeout: Duration) -> anyhow::Result<()> {
    check_name(name)?;
    let dir = vm_dir()?;
    if !is_running(&dir, name) {
        bail!("no VM named {name:?} is running");
    }
    let rec: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join(format!("{name}.json")))?)?;
    let pid = rec["pid"].as_i64().and_then(|p| i32::try_from(p).ok()).ok_or_else(|| anyhow!("{name}: the record has no pid"))?;
    // The record is in our private directory, but check the process is ours
    // before signalling it (a recycled pid).
    let status = std::fs::metadata(format!("/proc/{pid}")).with_context(|| format!("{name}: supervisor {pid} is gone"))?;
    if status.uid() != rustix::process::getuid().as_raw() {
        bail!("{name}: pid {pid} is not your process");
    }
    let pid = rustix::process::Pid::from_raw(pid).ok_or_else(|| anyhow!("bad pid"))?;
    rustix::process::kill_process(pid, rustix::process::Signal::TERM)?;
    let deadline = Instant::now() + timeout;
    while is_running(&dir, name) {
        if Instant::now() >= deadline {
            bail!("{name}: still running after {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    println!("stopped {name}");
    let _ = std::fs::Permissions::from_mode(0o600);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nic_takes_user_networking_with_forwards_only() {
        assert_eq!(parse_nic("user"), Ok(NicSpec::User { hostfwd: vec![] }));
        assert_eq!(parse_nic("user:4000-7001,4001-22"), Ok(NicSpec::User { hostfwd: vec![(4000, 7001), (4001, 22)] }));
        for bad in ["tap", "user:4000", "user:0-7001", "user:4000-70000", "user4000-1", "user:a-b"] {
            assert!(parse_nic(bad).is_err(), "{bad} accepted");
        }
    }
}
