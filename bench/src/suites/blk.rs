//! `fido-bench blk`: MMBlk's block devices beside the servers and system
//! calls a user would otherwise use, on the same backing in one run.
//!
//! * **NBD** (fio's `nbd` engine, one job): Fido's storage domain behind
//!   `fido blk nbd`, on RAM and on a tmpfs file, against `nbdkit memory`,
//!   `nbdkit file` and `qemu-nbd` (io_uring) on the same file.
//! * **Local** (fio's `psync` and `io_uring` engines): the file itself, the
//!   floor any server on it is measured against.
//! * **RAID-1**: the same NBD front end over a RAID-1 domain of two RAM
//!   storage domains, against a single RAM storage domain.
//! * **Inside a guest** ([`super::blk_vm`]): `dd` on a virtio-blk disk in a
//!   QEMU guest, served by `fido blk vhost` (vhost-user-blk), QEMU's own
//!   `-drive` and qemu-storage-daemon's vhost-user-blk export (cases
//!   `guest-*`; skipped without QEMU).
//!
//! Cases: `randread-4k-qd32` and `randwrite-4k-qd32` (IO/s), `write-1m` and
//! `read-1m` (sequential, QD 4, bytes/s). Every case of every system runs
//! the same fio job; only the target differs. A system whose programs are
//! missing (nbdkit, qemu-nbd, fio) is skipped and said so.
//!
//! What this suite must never do: report a figure fio did not measure in
//! this run, or leave a server, a socket or the backing file behind.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};

use crate::{Opts, Record};
use fido_demo::proc::EmbeddedBroker;

const SUITE: &str = "blk";

/// One fio job shape.
struct Case {
    name: &'static str,
    rw: &'static str,
    bs: &'static str,
    iodepth: u32,
    /// Report IO/s (random cases) rather than bytes/s.
    iops: bool,
}

const CASES: &[Case] = &[
    Case { name: "randread-4k-qd32", rw: "randread", bs: "4k", iodepth: 32, iops: true },
    Case { name: "randwrite-4k-qd32", rw: "randwrite", bs: "4k", iodepth: 32, iops: true },
    Case { name: "write-1m", rw: "write", bs: "1m", iodepth: 4, iops: false },
    Case { name: "read-1m", rw: "read", bs: "1m", iodepth: 4, iops: false },
];

/// A server we started: SIGTERM, then SIGKILL after 5 s, on drop.
pub(super) struct Server {
    pub(super) child: Child,
    pub(super) what: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(pid) = rustix::process::Pid::from_raw(self.child.id() as i32) {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
        }
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(5) {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        eprintln!("blk bench: {} did not exit on SIGTERM; killed", self.what);
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub(super) fn start(mut c: Command, what: &str, log: &Path) -> anyhow::Result<Server> {
    let out = std::fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
    c.stdin(Stdio::null())
        .stdout(out.try_clone()?)
        .stderr(out);
    let child = c.spawn().with_context(|| format!("starting {what}: {c:?}"))?;
    Ok(Server { child, what: what.to_string() })
}

/// Waits until `path` accepts a Unix connection (the server is up).
fn wait_socket(path: &Path, server: &mut Server, log: &Path) -> anyhow::Result<()> {
    let t = Instant::now();
    loop {
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            return Ok(());
        }
        if let Ok(Some(status)) = server.child.try_wait() {
            bail!(
                "{} exited ({status}) before listening:\n{}",
                server.what,
                std::fs::read_to_string(log).unwrap_or_default()
            );
        }
        if t.elapsed() > Duration::from_secs(30) {
            bail!("{} did not listen on {} within 30 s", server.what, path.display());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Whether `prog --version` (or `-V`) runs.
pub(super) fn have(prog: &str) -> bool {
    ["--version", "-V"].iter().any(|a| {
        Command::new(prog)
            .arg(a)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    })
}

/// Where fio's I/O goes.
enum Target<'a> {
    Nbd(&'a Path),
    File(&'a Path, &'static str),
}

/// Writes the whole device once (not measured): every system then reads
/// written blocks, not holes a server can answer without touching memory.
const FILL: Case = Case { name: "fill", rw: "write", bs: "1m", iodepth: 4, iops: false };

/// Runs one fio job and returns (IO/s, bytes/s, I/Os) of its direction;
/// `secs` 0: once over `size`, not time-based.
fn fio(target: &Target<'_>, case: &Case, size: u64, secs: u64, dir: &Path) -> anyhow::Result<(f64, f64, u64)> {
    let out = dir.join("fio.json");
    let mut c = Command::new("fio");
    c.arg("--name=job")
        .arg(format!("--rw={}", case.rw))
        .arg(format!("--bs={}", case.bs))
        .arg(format!("--iodepth={}", case.iodepth))
        .arg(format!("--size={size}"))
        .arg("--randrepeat=0")
        .arg("--norandommap")
        .arg("--output-format=json")
        .arg(format!("--output={}", out.display()));
    if secs > 0 {
        c.arg("--time_based").arg(format!("--runtime={secs}")).arg("--ramp_time=1");
    }
    match target {
        Target::Nbd(sock) => {
            c.arg("--ioengine=nbd").arg(format!("--uri=nbd+unix:///?socket={}", sock.display()));
        }
        Target::File(path, engine) => {
            c.arg(format!("--ioengine={engine}"))
                .arg(format!("--filename={}", path.display()));
            if *engine == "psync" {
                // psync has one request in flight per job: QD comes from jobs.
                c.arg(format!("--numjobs={}", case.iodepth.min(4))).arg("--group_reporting");
            }
        }
    }
    c.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let o = c.output().context("running fio")?;
    if !o.status.success() {
        bail!(
            "fio failed ({}): {}{}",
            o.status,
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
    }
    let text = std::fs::read_to_string(&out).context("reading fio's JSON")?;
    // fio may print warnings before the JSON object.
    let start = text.find('{').context("no JSON in fio's output")?;
    let v: serde_json::Value = serde_json::from_str(&text[start..]).context("parsing fio's JSON")?;
    let job = &v["jobs"][0];
    let dir_key = if case.rw.contains("read") { "read" } else { "write" };
    let d = &job[dir_key];
    let iops = d["iops"].as_f64().context("fio JSON: no iops")?;
    let bw = d["bw_bytes"].as_f64().context("fio JSON: no bw_bytes")?;
    let ios = d["total_ios"].as_u64().unwrap_or(0);
    let errors = job["error"].as_i64().unwrap_or(0);
    if errors != 0 || ios == 0 {
        bail!("fio reported error {errors} after {ios} I/Os");
    }
    Ok((iops, bw, ios))
}

fn record(case: &Case, system: &str, iops: f64, bw: f64, ios: u64) -> Record {
    if case.iops {
        Record {
            suite: SUITE.into(),
            case: case.name.into(),
            system: system.into(),
            metric: "iops".into(),
            value: iops,
            unit: "IO/s".into(),
            p50: None,
            p99: None,
            n: ios,
        }
    } else {
        Record::throughput(SUITE, case.name, system, bw, ios)
    }
}

/// The native API on `service`: one client domain keeping `case.iodepth`
/// requests in flight for `secs` (random block offsets for the random
/// cases, sequential otherwise). Reads fold every byte of the reply (a
/// user reads what it asked for); writes send a buffer of the client's
/// arena, filled once. Returns (IO/s, bytes/s, I/Os, bytes the client
/// copied).
fn native(d: &fido::Domain, service: &str, case: &Case, secs: u64) -> anyhow::Result<(f64, f64, u64, u64)> {
    let copied_before = d.counters().bytes_copied;
    let c = fido_blk::BlkClient::connect(d, service)?;
    let bs: u32 = if case.bs == "4k" { 4096 } else { 1 << 20 };
    let write = case.rw.contains("write");
    let random = case.rw.starts_with("rand");
    let blocks = c.info().size / u64::from(bs);
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut seq = 0u64;
    let mut next_off = move || {
        let b = if random {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % blocks
        } else {
            seq = (seq + 1) % blocks;
            seq
        };
        b * u64::from(bs)
    };
    let submit = |id: u64, off: u64| -> anyhow::Result<()> {
        if write {
            let mut buf = c.alloc(bs as usize)?;
            crate::fill(&mut buf, id);
            c.submit_write(id, off, vec![buf], false)?;
        } else {
            c.submit_read(id, off, bs)?;
        }
        Ok(())
    };
    let mut sink = 0u64;
    let mut id = 0u64;
    for _ in 0..case.iodepth {
        submit(id, next_off())?;
        id += 1;
    }
    // Warm-up, then the measured run.
    let mut measured = None;
    let warm_end = Instant::now() + Duration::from_secs(1);
    let mut done = 0u64;
    let end = warm_end + Duration::from_secs(secs);
    loop {
        let now = Instant::now();
        if measured.is_none() && now >= warm_end {
            measured = Some(now);
            done = 0;
        }
        if now >= end {
            break;
        }
        let r = c.complete(Duration::from_secs(30))?;
        if let Some(m) = r.result.with_context(|| format!("request {}", r.id))? {
            for seg in m.segments() {
                sink = seg.fold_u64(sink, |a, w| a.wrapping_add(w));
            }
        }
        done += 1;
        submit(id, next_off())?;
        id += 1;
    }
    let elapsed = measured.map_or(Duration::ZERO, |t| t.elapsed()).as_secs_f64();
    for _ in 0..case.iodepth {
        c.complete(Duration::from_secs(30))?.result?;
    }
    std::hint::black_box(sink);
    if done == 0 || elapsed <= 0.0 {
        bail!("no request completed");
    }
    let iops = done as f64 / elapsed;
    Ok((iops, iops * f64::from(bs), done, d.counters().bytes_copied - copied_before))
}

/// The backing every system shares: a file on tmpfs, and its size.
struct Backing {
    dir: tempfile::TempDir,
    file: PathBuf,
}

fn backing(size: u64) -> anyhow::Result<Backing> {
    let dir = tempfile::Builder::new()
        .prefix("fido-bench-blk-")
        .tempdir_in("/dev/shm")
        .context("a directory on /dev/shm (tmpfs)")?;
    let file = dir.path().join("disk.img");
    let f = std::fs::File::create(&file)?;
    f.set_len(size)?;
    Ok(Backing { dir, file })
}

/// How one NBD system is started: its servers in order, each with the
/// block service it offers (the next one connects to it), the last one
/// listening on the NBD socket.
struct NbdSystem {
    name: String,
    servers: Vec<(Command, Option<&'static str>)>,
    /// The block service the native API is also measured on.
    native: Option<&'static str>,
}

/// Waits until the block service `name` answers `fido blk info`.
pub(super) fn wait_service(fido: &Path, broker: &Path, name: &str, server: &mut Server, log: &Path) -> anyhow::Result<()> {
    let t = Instant::now();
    loop {
        let ok = Command::new(fido)
            .args(["blk", "info", name])
            .env("FIDO_BROKER", broker)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if ok {
            return Ok(());
        }
        if let Ok(Some(status)) = server.child.try_wait() {
            bail!(
                "{} exited ({status}) before offering blk:{name}:\n{}",
                server.what,
                std::fs::read_to_string(log).unwrap_or_default()
            );
        }
        if t.elapsed() > Duration::from_secs(30) {
            bail!("{} did not offer blk:{name} within 30 s", server.what);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

pub fn run(opts: &Opts) -> anyhow::Result<()> {
    if !have("fio") {
        bail!("fio is not installed (apt-get install fio): every case of this suite runs it");
    }
    let secs = if opts.quick { 2 } else { 8 };
    let size: u64 = if opts.quick { 256 << 20 } else { 1 << 30 };
    let back = backing(size)?;
    let fido = std::env::current_exe()?.with_file_name("fido");
    let broker = EmbeddedBroker::start("fido-bench-blk-broker-")?;
    let bsock = broker.socket().to_path_buf();
    let dir = back.dir.path();
    let mut records = Vec::new();
    let mut skipped = Vec::new();

    // --- local floors -------------------------------------------------------
    fio(&Target::File(&back.file, "io_uring"), &FILL, size, 0, dir).context("filling the backing file")?;
    for engine in ["psync", "io_uring"] {
        let system = format!("file-{engine}");
        for case in CASES {
            if !opts.wants(&system, case.name) {
                continue;
            }
            let (iops, bw, ios) = fio(&Target::File(&back.file, engine), case, size, secs, dir)
                .with_context(|| format!("{system} {}", case.name))?;
            records.push(record(case, &system, iops, bw, ios));
        }
    }

    // --- NBD servers ----------------------------------------------------------
    let sock = dir.join("nbd.sock");
    let fido_cmd = |args: &[&str]| {
        let mut c = Command::new(&fido);
        c.args(args).env("FIDO_BROKER", &bsock);
        c
    };
    let size_arg = size.to_string();
    let sock_arg = sock.display().to_string();
    let file_arg = back.file.display().to_string();
    let mut systems = vec![
        NbdSystem {
            name: "fido-ram".into(),
            native: Some("bench-ram"),
            servers: vec![
                (fido_cmd(&["blk", "serve", "bench-ram", "--ram", &size_arg]), Some("bench-ram")),
                (fido_cmd(&["blk", "nbd", "bench-ram", "--unix", &sock_arg]), None),
            ],
        },
        NbdSystem {
            name: "fido-file".into(),
            native: Some("bench-file"),
            servers: vec![
                (fido_cmd(&["blk", "serve", "bench-file", "--file", &file_arg]), Some("bench-file")),
                (fido_cmd(&["blk", "nbd", "bench-file", "--unix", &sock_arg]), None),
            ],
        },
        NbdSystem {
            name: "fido-raid1-ram".into(),
            native: Some("bench-r1"),
            servers: vec![
                (fido_cmd(&["blk", "serve", "bench-m0", "--ram", &size_arg]), Some("bench-m0")),
                (fido_cmd(&["blk", "serve", "bench-m1", "--ram", &size_arg]), Some("bench-m1")),
                (
                    fido_cmd(&["blk", "raid1", "bench-r1", "--member", "bench-m0", "--member", "bench-m1"]),
                    Some("bench-r1"),
                ),
                (fido_cmd(&["blk", "nbd", "bench-r1", "--unix", &sock_arg]), None),
            ],
        },
    ];
    if have("nbdkit") {
        let mut m = Command::new("nbdkit");
        m.args(["--foreground", "--exit-with-parent", "-U", &sock_arg, "memory", &size_arg]);
        let mut f = Command::new("nbdkit");
        f.args(["--foreground", "--exit-with-parent", "-U", &sock_arg, "file", &file_arg]);
        systems.push(NbdSystem { name: "nbdkit-memory".into(), servers: vec![(m, None)], native: None });
        systems.push(NbdSystem { name: "nbdkit-file".into(), servers: vec![(f, None)], native: None });
    } else {
        skipped.push("nbdkit (apt-get install nbdkit)");
    }
    if have("qemu-nbd") {
        let mut q = Command::new("qemu-nbd");
        // qemu-nbd's fastest settings a user would pick for a file on
        // tmpfs: raw, io_uring, no O_DIRECT (tmpfs has none), several
        // clients allowed, serving on after a client leaves.
        q.args(["-k", &sock_arg, "--persistent", "-f", "raw", "--aio=io_uring", "--cache=writeback", "--shared=8", &file_arg]);
        systems.push(NbdSystem { name: "qemu-nbd".into(), servers: vec![(q, None)], native: None });
    } else {
        skipped.push("qemu-nbd (apt-get install qemu-utils)");
    }
    let mut client: Option<fido::Domain> = None;
    for sys in systems {
        let wanted: Vec<&Case> = CASES
            .iter()
            .filter(|c| opts.wants(&sys.name, c.name))
            .collect();
        let native_system = sys.name.replace("fido-", "fido-native-");
        let native_wanted = sys.native.is_some() && CASES.iter().any(|c| opts.wants(&native_system, c.name));
        if wanted.is_empty() && !native_wanted {
            continue;
        }
        let _ = std::fs::remove_file(&sock);
        let mut running = Vec::new();
        for (i, (c, offers)) in sys.servers.into_iter().enumerate() {
            let log = dir.join(format!("{}-{i}.log", sys.name));
            let mut s = start(c, &format!("{} server {i}", sys.name), &log)?;
            match offers {
                Some(service) => wait_service(&fido, &bsock, service, &mut s, &log)?,
                None => wait_socket(&sock, &mut s, &log)?,
            }
            running.push(s);
        }
        fio(&Target::Nbd(&sock), &FILL, size, 0, dir).with_context(|| format!("{}: filling the device", sys.name))?;
        for case in wanted {
            let (iops, bw, ios) = fio(&Target::Nbd(&sock), case, size, secs, dir)
                .with_context(|| format!("{} {}", sys.name, case.name))?;
            records.push(record(case, &sys.name, iops, bw, ios));
        }
        if let Some(service) = sys.native {
            let system = sys.name.replace("fido-", "fido-native-");
            for case in CASES.iter().filter(|c| opts.wants(&system, c.name)) {
                if client.is_none() {
                    // One client domain for every native case: a process
                    // holds one PGVAS window.
                    client = Some(fido::Domain::join(
                        fido::JoinOptions::new("fido-bench-blk")
                            .broker(&bsock)
                            .arena_len(1 << 30)
                            .ring_entries(256),
                    )?);
                }
                let d = client.as_ref().expect("joined above");
                let (iops, bw, ios, copied) = native(d, service, case, secs)
                    .with_context(|| format!("{system} {}", case.name))?;
                if case.rw.contains("write") && copied != 0 {
                    bail!("{system} {}: the client copied {copied} bytes on the write path", case.name);
                }
                records.push(record(case, &system, iops, bw, ios));
            }
        }
        // Last started, first stopped: the front end before its backends.
        while let Some(s) = running.pop() {
            drop(s);
        }
    }
    drop(client);

    // --- inside a guest: virtio-blk from fido blk vhost, QEMU, qemu-storage-daemon
    super::blk_vm::run(opts, &fido, &bsock, dir, &mut records, &mut skipped)?;
    drop(broker);

    let machine = machine();
    println!("{}", machine.header());
    crate::print_rows(&records);
    for s in &skipped {
        println!("skipped: {s}");
    }
    for line in goal_lines(&records) {
        println!("{line}");
    }
    if let Some(path) = &opts.json {
        crate::write_json_on(path, &records, &machine)?;
    }
    Ok(())
}

/// The machine the run measured ([`crate::Machine`]) with the baselines' versions.
fn machine() -> crate::Machine {
    let first_line = |cmd: &str, args: &[&str]| {
        Command::new(cmd)
            .args(args)
            .output()
            .ok()
            .and_then(|o| String::from_utf8_lossy(&o.stdout).lines().next().map(str::to_string))
            .unwrap_or_default()
    };
    crate::Machine::describe("unpinned (fio, the NBD servers, the broker and QEMU scheduled by the kernel)")
        .with("fio", first_line("fio", &["--version"]))
        .with("nbdkit", first_line("nbdkit", &["--version"]))
        .with("qemu", first_line("qemu-system-x86_64", &["--version"]))
}

/// The goals, from this run's own ratios (a goal whose systems did
/// not run is not printed).
fn goal_lines(records: &[Record]) -> Vec<String> {
    let value = |case: &str, system: &str| {
        records.iter().find(|r| r.case == case && r.system == system).map(|r| r.value)
    };
    let mut out = Vec::new();
    let mut goal = |what: &str, num: Option<f64>, den: Option<f64>, at_least: f64| {
        if let (Some(n), Some(d)) = (num, den) {
            if d > 0.0 {
                let ratio = n / d;
                let verdict = if ratio >= at_least { "met" } else { "NOT met" };
                out.push(format!("goal: {what}: {ratio:.2}x (>= {at_least}x) {verdict}"));
            }
        }
    };
    for case in ["randread-4k-qd32", "write-1m"] {
        goal(&format!("{case} NBD fido-ram vs nbdkit-memory"), value(case, "fido-ram"), value(case, "nbdkit-memory"), 1.0);
        goal(&format!("{case} NBD fido-ram vs qemu-nbd"), value(case, "fido-ram"), value(case, "qemu-nbd"), 1.5);
    }
    goal(
        "randread-4k-qd32 native vs NBD (fido-ram)",
        value("randread-4k-qd32", "fido-native-ram"),
        value("randread-4k-qd32", "fido-ram"),
        1.5,
    );
    for case in ["write-1m", "randwrite-4k-qd32"] {
        goal(
            &format!("{case} RAID-1 vs one storage domain (native)"),
            value(case, "fido-native-raid1-ram"),
            value(case, "fido-native-ram"),
            0.8,
        );
    }
    for case in ["guest-write-1m", "guest-read-1m", "guest-4k-qd1-read"] {
        goal(&format!("{case} fido-vhost vs qsd-vhost"), value(case, "fido-vhost"), value(case, "qsd-vhost"), 1.0);
        goal(&format!("{case} fido-vhost vs qemu-virtio"), value(case, "fido-vhost"), value(case, "qemu-virtio"), 1.0);
    }
    out
}
