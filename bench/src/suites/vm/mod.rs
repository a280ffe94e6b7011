//! `fido-bench vm`: Fido between a host process and a VM and between two VMs,
//! against what a competent user would use there instead — TCP over
//! virtio-net (`virtio-net-tcp`) and raw bytes over a virtio-serial port
//! (`virtio-serial`, host↔VM only) — all in the same VMs, under the same
//! accelerator, in one invocation.
//!
//! Two VMs are booted once per run from the test guest (scripts/vm-image.sh,
//! with this binary at /bin/fido-bench). In each, `fido-bench vm-endpoint
//! --mode agent` ([`endpoint`]) runs the guest side of every case on the
//! host's command. The host side runs here.
//!
//! * `host-vm-latency-<size>`, `vm-vm-latency-<size>`: ping-pong, one message
//!   in flight; the pinger writes every byte of message `k`, the echo side
//!   folds every byte and answers with the same bytes, the pinger checks every
//!   byte of the answer; one-way = RTT/2, p50 and p99 (host↔VM: the host
//!   pings, host clock; VM↔VM: VM a pings VM b, VM a's clock).
//! * `host-vm-throughput-<size>`, `vm-vm-throughput-<size>`: a one-way stream
//!   (VM → host; VM a → VM b); the sender writes every byte of every message,
//!   the receiver folds every byte; the receiver's message count and checksum
//!   are checked against what was sent; bytes/s at the receiver from the first
//!   message to the last. The stream baselines write through a 256 KiB
//!   user-space buffer (`stream::STREAM_BUFFER`), so small messages travel
//!   many to a system call; `fido` sends one descriptor per message, and
//!   `fido-batched` packs as many messages as fill 256 KiB into each Fido
//!   message (each still written and folded whole), batching as they do.
//!
//! Network: a network namespace of our own with a bridge; each VM's
//! virtio-net is a tap on it (vhost off: no /dev/vhost-net here), the host's
//! side of a host↔VM case runs on a thread inside the namespace, talking to
//! the bridge's address. TCP_NODELAY for latency, 4 MiB socket buffers for
//! throughput, one connection.

mod endpoint;
mod fidoops;
pub(crate) mod rig;
mod stream;

use std::io::Write as _;
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use fido::{Domain, JoinOptions, WaitStrategy};
use serde_json::json;

use crate::{size_label, Opts, Record};
use endpoint::Kv;
use rig::{Launcher, Netns, Vm};

pub use endpoint::main as endpoint_main;

const SUITE: &str = "vm";
const SIZES: [usize; 3] = [64, 4 << 10, 64 << 10];
const VM_MEM_MIB: u32 = 512;
/// Boot of two TCG guests on a loaded 2-core machine.
const BOOT: Duration = Duration::from_secs(300);
/// How long a case may take beyond its measured time.
const SLACK: Duration = Duration::from_secs(90);

const FIDO: &str = "fido";
const FIDO_POLLED: &str = "fido-polled";
const TCP: &str = "virtio-net-tcp";
const SERIAL: &str = "virtio-serial";
/// Throughput with messages batched into one Fido message each
/// [`stream::STREAM_BUFFER`], as the stream baselines batch their writes.
const FIDO_BATCHED: &str = "fido-batched";

fn fido_system(batch: usize) -> &'static str {
    if batch > 1 {
        FIDO_BATCHED
    } else {
        FIDO
    }
}

/// One result row: a [`Record`] and, for Fido rows, the bytes the domains of
/// the case copied (the host's and the guests' counters).
struct Row {
    record: Record,
    bytes_copied: Option<u64>,
}

struct Bench<'a> {
    opts: &'a Opts,
    ns: &'a Netns,
    a: Vm,
    b: Vm,
    /// The host's Fido domain (when the VMs are Fido domains).
    host: Option<Domain>,
    next_port: u16,
    next_svc: u32,
}

impl Bench<'_> {
    fn warmup(&self) -> Duration {
        if self.opts.quick {
            Duration::from_millis(200)
        } else {
            Duration::from_secs(1)
        }
    }

    fn duration(&self) -> Duration {
        if self.opts.quick {
            Duration::from_millis(1000)
        } else {
            Duration::from_secs(4)
        }
    }

    fn port(&mut self) -> u16 {
        self.next_port += 1;
        self.next_port
    }

    fn svc(&mut self) -> String {
        self.next_svc += 1;
        format!("bench-vm-{}-{}", std::process::id(), self.next_svc)
    }

    fn done_timeout(&self) -> Duration {
        self.warmup() + self.duration() + SLACK
    }

    fn latency_row(system: &str, case: &str, rtts: Vec<u64>, bytes_copied: Option<u64>) -> Row {
        let mut r = crate::latency_record(system, case, rtts);
        r.suite = SUITE.into();
        Row {
            record: r,
            bytes_copied,
        }
    }

    fn rtt_row(
        system: &str,
        case: &str,
        kv: &Kv,
        bytes_copied: Option<u64>,
    ) -> anyhow::Result<Row> {
        let (p50, p99): (f64, f64) = (kv.num("rtt_p50")?, kv.num("rtt_p99")?);
        Ok(Row {
            record: Record::latency(SUITE, case, system, p50 / 2.0, p99 / 2.0, kv.num("n")?),
            bytes_copied,
        })
    }

    fn throughput_row(
        system: &str,
        case: &str,
        size: usize,
        sink: stream::SinkReport,
        sent: u64,
        bytes_copied: Option<u64>,
    ) -> anyhow::Result<Row> {
        sink.verify(Some(sent), size)?;
        Ok(Row {
            record: Record::throughput(SUITE, case, system, sink.bytes_per_s(size), sink.messages),
            bytes_copied,
        })
    }

    // ---- host ↔ VM -------------------------------------------------------

    fn host_vm_latency_tcp(&mut self, case: &str, size: usize) -> anyhow::Result<Row> {
        let port = self.port();
        self.a
            .ctl
            .start(&format!("tcp-echo port={port} size={size}"))?;
        let (addr, warm, dur) = (self.a.addr.clone(), self.warmup(), self.duration());
        let rtts = self.ns.run(move || {
            let mut s = TcpStream::connect((addr.as_str(), port))?;
            s.set_read_timeout(Some(fidoops::STALL))?;
            s.set_nodelay(true)?;
            stream::ping_pong(&mut s, size, warm, dur)
        });
        let done = self.a.ctl.expect("done", self.done_timeout());
        let rtts = rtts?;
        done?;
        Ok(Self::latency_row(TCP, case, rtts, None))
    }

    fn host_vm_throughput_tcp(&mut self, case: &str, size: usize) -> anyhow::Result<Row> {
        let port = self.port();
        let ms = self.duration().as_millis();
        let timeout = self.done_timeout();
        let ctl = &mut self.a.ctl;
        let sink = self.ns.run(|| {
            let l = TcpListener::bind((rig::HOST_ADDR, port))?;
            ctl.send(&format!(
                "tcp-source addr={} port={port} size={size} ms={ms}",
                rig::HOST_ADDR
            ))?;
            let mut s = endpoint::accept_one(&l)?;
            s.set_read_timeout(Some(fidoops::STALL))?;
            endpoint::big_buffers(&s)?;
            stream::sink(&mut s, size)
        });
        let done = self.a.ctl.expect("done", timeout);
        let sink = sink?;
        let sent = done?.num("messages")?;
        Self::throughput_row(TCP, case, size, sink, sent, None)
    }

    fn host_vm_latency_serial(&mut self, case: &str, size: usize) -> anyhow::Result<Row> {
        self.a.ctl.start(&format!("serial-echo size={size}"))?;
        let mut s = self.a.serial.try_clone()?;
        let rtts = stream::ping_pong(&mut s, size, self.warmup(), self.duration());
        let done = self.a.ctl.expect("done", self.done_timeout());
        let rtts = rtts?;
        done?;
        Ok(Self::latency_row(SERIAL, case, rtts, None))
    }

    fn host_vm_throughput_serial(&mut self, case: &str, size: usize) -> anyhow::Result<Row> {
        let ms = self.duration().as_millis();
        self.a
            .ctl
            .start(&format!("serial-source size={size} ms={ms}"))?;
        let mut s = self.a.serial.try_clone()?;
        let sink = stream::sink(&mut s, size);
        let done = self.a.ctl.expect("done", self.done_timeout());
        let sink = sink?;
        let sent = done?.num("messages")?;
        Self::throughput_row(SERIAL, case, size, sink, sent, None)
    }

    fn host_domain(&self) -> anyhow::Result<Domain> {
        self.host.clone().context("no host domain")
    }

    fn host_vm_latency_fido(&mut self, case: &str, size: usize, wait: &str) -> anyhow::Result<Row> {
        let d = self.host_domain()?;
        let svc = self.svc();
        self.a
            .ctl
            .start(&format!("fido-echo svc={svc} size={size} wait={wait}"))?;
        let before = d.counters().bytes_copied;
        let rtts = (|| {
            let ch = d.connect(&svc)?;
            ch.set_wait(fidoops::parse_wait(wait)?);
            let r = fidoops::ping_pong(&d, &ch, size, self.warmup(), self.duration());
            let _ = fido_demo::pipeline::drain(&ch, Duration::from_secs(5));
            r
        })();
        let done = self.a.ctl.expect("done", self.done_timeout());
        let rtts = rtts.map_err(|e| match &done {
            Err(guest) => e.context(format!("the guest's side: {guest:#}")),
            Ok(_) => e,
        })?;
        let guest: u64 = done?.num("bytes_copied")?;
        let copied = d.counters().bytes_copied - before + guest;
        let system = if wait == "poll" { FIDO_POLLED } else { FIDO };
        Ok(Self::latency_row(system, case, rtts, Some(copied)))
    }

    /// `batch`: messages per Fido message (1, or [`fidoops::batch_for`] for
    /// [`FIDO_BATCHED`]).
    fn host_vm_throughput_fido(&mut self, case: &str, size: usize, batch: usize) -> anyhow::Result<Row> {
        let d = self.host_domain()?;
        let svc = self.svc();
        let ms = self.duration().as_millis();
        self.a.ctl.start(&format!(
            "fido-source svc={svc} size={size} ms={ms} wait=block batch={batch}"
        ))?;
        let before = d.counters().bytes_copied;
        let sink = (|| {
            let ch = d.connect(&svc)?;
            ch.set_wait(WaitStrategy::default());
            fidoops::sink(&ch, size)
        })();
        let done = self.a.ctl.expect("done", self.done_timeout());
        let sink = sink?;
        let done = done?;
        let copied = d.counters().bytes_copied - before + done.num::<u64>("bytes_copied")?;
        Self::throughput_row(fido_system(batch), case, size, sink, done.num("messages")?, Some(copied))
    }

    // ---- VM ↔ VM ---------------------------------------------------------

    /// Starts `b_cmd` on VM b (which answers `ready`), then `a_cmd` on VM a;
    /// returns both `done`s.
    fn pair(&mut self, b_cmd: &str, a_cmd: &str) -> anyhow::Result<(Kv, Kv)> {
        self.b.ctl.start(b_cmd)?;
        self.a.ctl.send(a_cmd)?;
        let t = self.done_timeout();
        let a = self.a.ctl.expect("done", t);
        let b = self.b.ctl.expect("done", t);
        Ok((a?, b?))
    }

    fn vm_vm_latency_tcp(&mut self, case: &str, size: usize) -> anyhow::Result<Row> {
        let port = self.port();
        let (warm, ms) = (self.warmup().as_millis(), self.duration().as_millis());
        let b_addr = self.b.addr.clone();
        let (a, _) = self.pair(
            &format!("tcp-echo port={port} size={size}"),
            &format!("tcp-ping addr={b_addr} port={port} size={size} warm_ms={warm} ms={ms}"),
        )?;
        Self::rtt_row(TCP, case, &a, None)
    }

    fn vm_vm_throughput_tcp(&mut self, case: &str, size: usize) -> anyhow::Result<Row> {
        let port = self.port();
        let ms = self.duration().as_millis();
        let b_addr = self.b.addr.clone();
        let (a, b) = self.pair(
            &format!("tcp-sink port={port} size={size}"),
            &format!("tcp-source addr={b_addr} port={port} size={size} ms={ms}"),
        )?;
        let sink = endpoint::parse_sink(&b)?;
        Self::throughput_row(TCP, case, size, sink, a.num("messages")?, None)
    }

    fn vm_vm_latency_fido(&mut self, case: &str, size: usize, wait: &str) -> anyhow::Result<Row> {
        let svc = self.svc();
        let (warm, ms) = (self.warmup().as_millis(), self.duration().as_millis());
        let (a, b) = self.pair(
            &format!("fido-echo svc={svc} size={size} wait={wait}"),
            &format!("fido-ping svc={svc} size={size} wait={wait} warm_ms={warm} ms={ms}"),
        )?;
        let copied = a.num::<u64>("bytes_copied")? + b.num::<u64>("bytes_copied")?;
        let system = if wait == "poll" { FIDO_POLLED } else { FIDO };
        Self::rtt_row(system, case, &a, Some(copied))
    }

    fn vm_vm_throughput_fido(&mut self, case: &str, size: usize, batch: usize) -> anyhow::Result<Row> {
        let svc = self.svc();
        let ms = self.duration().as_millis();
        let (a, b) = self.pair(
            &format!("fido-sink svc={svc} size={size}"),
            &format!("fido-source-to svc={svc} size={size} ms={ms} batch={batch}"),
        )?;
        let copied = a.num::<u64>("bytes_copied")? + b.num::<u64>("bytes_copied")?;
        let sink = endpoint::parse_sink(&b)?;
        Self::throughput_row(fido_system(batch), case, size, sink, a.num("messages")?, Some(copied))
    }
}

/// Asks both guests' agents to join Fido.
fn vms_probe(a: &mut Vm, b: &mut Vm) -> Vec<anyhow::Result<Kv>> {
    [a, b]
        .into_iter()
        .map(|vm| {
            vm.ctl.send("fido-probe")?;
            vm.ctl.expect("done", Duration::from_secs(120))
        })
        .collect()
}

/// Where `fido vm` would come from: the `fido` CLI beside this executable,
/// if it has the `vm run` command.
fn fido_vm_cli() -> Option<PathBuf> {
    let fido = std::env::current_exe().ok()?.with_file_name("fido");
    let ok = std::process::Command::new(&fido)
        .args(["vm", "run", "--help"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    ok.then_some(fido)
}

fn first_line(cmd: &str, args: &[&str]) -> String {
    std::process::Command::new(cmd)
        .args(args)
        .output()
        .ok()
        .and_then(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .next()
                .map(str::to_string)
        })
        .unwrap_or_default()
}

/// The machine a row was measured on ([`crate::Machine`]) with QEMU, the
/// accelerator and the guests.
fn machine(image: &rig::Image) -> crate::Machine {
    crate::Machine::describe(
        "QEMU guests unpinned (each VM 1 vCPU thread, scheduled by the host); host-side peers unpinned",
    )
    .with("qemu", first_line("qemu-system-x86_64", &["--version"]))
    .with("accel", rig::accel().0)
    .with("accel_why", rig::accel().1.clone())
    .with("guest", format!("{} vCPU, {VM_MEM_MIB} MiB, -smp {}, -cpu {}, {}", 1, rig::guest_smp(), rig::guest_cpu(), image.kernel.display()))
}

fn find<'a>(rows: &'a [Row], case: &str, system: &str) -> Option<&'a Record> {
    rows.iter()
        .map(|r| &r.record)
        .find(|r| r.case == case && r.system == system && r.metric != "bytes_copied")
}

/// The goals, from this run's own ratios: throughput ≥ 5× virtio-net
/// TCP, latency ≤ 0.5×, for each path and size.
fn goal_lines(rows: &[Row]) -> Vec<String> {
    let mut out = Vec::new();
    for path in ["host-vm", "vm-vm"] {
        for &size in &SIZES {
            let l = size_label(size);
            let tput = format!("{path}-throughput-{l}");
            let lat = format!("{path}-latency-{l}");
            let mut goal = |case: &str, fido: &str, want: &str, met: fn(f64) -> bool| {
                if !rows.iter().any(|r| r.record.case == case) {
                    return; // filtered out
                }
                let verdict = match (find(rows, case, fido), find(rows, case, TCP)) {
                    (Some(f), Some(t)) if t.value > 0.0 => {
                        let ratio = f.value / t.value;
                        format!("{ratio:.2}x {}", if met(ratio) { "met" } else { "NOT met" })
                    }
                    (None, _) => format!("not measured ({fido} did not run)"),
                    _ => format!("not measured ({TCP} did not run)"),
                };
                out.push(format!(
                    "# goal {case}: {fido} {want} virtio-net-tcp: {verdict}"
                ));
            };
            // The stream baselines batch messages into 256 KiB writes:
            // `fido` (a descriptor per message) against that, and
            // `fido-batched` (batched the same way) like for like.
            goal(&tput, FIDO, "(a descriptor per message) throughput >= 5x", |r| r >= 5.0);
            goal(&tput, FIDO_BATCHED, "(batched like tcp) throughput >= 5x", |r| r >= 5.0);
            goal(&lat, FIDO, "latency <= 0.5x", |r| r <= 0.5);
            goal(&lat, FIDO_POLLED, "latency <= 0.5x", |r| r <= 0.5);
        }
    }
    out
}

fn write_json(
    path: &std::path::Path,
    rows: &[Row],
    machine: &crate::Machine,
) -> anyhow::Result<()> {
    let machine = machine.to_json();
    let mut w = std::io::BufWriter::new(
        std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?,
    );
    for r in rows {
        let mut v = serde_json::to_value(&r.record)?;
        let o = v.as_object_mut().expect("a record is an object");
        o.insert("machine".into(), machine.clone());
        if let Some(c) = r.bytes_copied {
            o.insert("bytes_copied".into(), json!(c));
        }
        serde_json::to_writer(&mut w, &v)?;
        w.write_all(b"\n")?;
    }
    w.flush()?;
    Ok(())
}

type CaseFn = Box<dyn FnOnce(&mut Bench) -> anyhow::Result<Row>>;

/// `fido-bench vm`.
pub fn run(opts: &Opts) -> anyhow::Result<()> {
    fido_demo::proc::install_interrupt_flag()?;
    for (prog, why) in [
        (
            "qemu-system-x86_64",
            "QEMU (Debian package qemu-system-x86)",
        ),
        ("ip", "iproute2"),
        ("strip", "binutils"),
    ] {
        if first_line("sh", &["-c", &format!("command -v {prog}")]).is_empty() {
            bail!("{prog} is not installed ({why}; scripts/install-test-deps.sh)");
        }
    }
    if !rustix::process::geteuid().is_root() {
        bail!("the vm suite creates a network namespace with a bridge and taps: run it as root");
    }
    let t0 = Instant::now();
    let image = rig::build_image().context("building the test guest")?;
    println!("# vm: accelerator {}", rig::accel().1);
    let machine = machine(&image);
    let ns = Netns::create()?;
    let dir = tempfile::Builder::new()
        .prefix("fido-bench-vm-")
        .tempdir()?;

    // The VMs are Fido domains when `fido vm` exists; the baselines run in
    // them all the same.
    let fido_cli = fido_vm_cli();
    let broker = match &fido_cli {
        Some(_) => Some(fido_demo::proc::EmbeddedBroker::start("fido-bench-vm-")?),
        None => None,
    };
    let launcher = match (&fido_cli, &broker) {
        (Some(fido), Some(b)) => Launcher::FidoVm {
            fido: fido.clone(),
            broker: b.socket().to_path_buf(),
        },
        _ => {
            println!("# fido: needs `fido vm` (not built yet): the fido and fido-polled cases are skipped");
            Launcher::Qemu
        }
    };
    let mut launched = Vec::new();
    for i in 0..2 {
        ns.add_tap(&format!("fbtap{i}"))?;
        let started = Instant::now();
        launched.push((
            rig::launch(&launcher, &image, &ns, dir.path(), i, VM_MEM_MIB)?,
            started,
        ));
    }
    let mut vms = Vec::new();
    for ((child, paths), started) in launched {
        vms.push(paths.wait_agent(child, started, BOOT)?);
    }
    let mut b = vms.pop().expect("two VMs");
    let mut a = vms.pop().expect("two VMs");
    eprintln!(
        "vm bench: {} up in {:.1} s, {} in {:.1} s ({}; accel {})",
        a.name,
        a.boot.as_secs_f64(),
        b.name,
        b.boot.as_secs_f64(),
        match launcher {
            Launcher::Qemu => "plain QEMU",
            Launcher::FidoVm { .. } => "fido vm run",
        },
        rig::accel().1
    );
    let host = match &broker {
        Some(br) => Some(
            Domain::join(
                JoinOptions::new("bench-vm-host")
                    .broker(br.socket())
                    .arena_len(256 << 20)
                    .ring_entries(64),
            )
            .context("joining the broker from the host")?,
        ),
        None => None,
    };
    // `fido vm run` made the VMs Fido domains; whether a guest's `fido`
    // library can join is the guest's to say (it is built separately).
    let mut fido_on = host.is_some();
    if fido_on {
        if let Some(Err(e)) = vms_probe(&mut a, &mut b).into_iter().find(|r| r.is_err()) {
            println!("# fido: the guest side of `fido` cannot join ({e:#}): the fido and fido-polled cases are skipped");
            fido_on = false;
        }
    }
    let mut bench = Bench {
        opts,
        ns: &ns,
        a,
        b,
        host,
        next_port: 5200,
        next_svc: 0,
    };

    let mut cases: Vec<(String, &str, CaseFn)> = Vec::new();
    // Each case's closure gets its name (the row's label) and message size.
    type Measure = fn(&mut Bench, &str, usize) -> anyhow::Result<Row>;
    let mut add = |case: &str, size: usize, system: &'static str, f: Measure| {
        let c = case.to_string();
        cases.push((c.clone(), system, Box::new(move |b| f(b, &c, size))));
    };
    for &size in &SIZES {
        let lat = format!("host-vm-latency-{}", size_label(size));
        add(&lat, size, FIDO, |b, c, size| b.host_vm_latency_fido(c, size, "block"));
        add(&lat, size, FIDO_POLLED, |b, c, size| b.host_vm_latency_fido(c, size, "poll"));
        add(&lat, size, TCP, |b, c, size| b.host_vm_latency_tcp(c, size));
        add(&lat, size, SERIAL, |b, c, size| b.host_vm_latency_serial(c, size));
    }
    for &size in &SIZES {
        let tp = format!("host-vm-throughput-{}", size_label(size));
        add(&tp, size, FIDO, |b, c, size| b.host_vm_throughput_fido(c, size, 1));
        add(&tp, size, FIDO_BATCHED, |b, c, size| b.host_vm_throughput_fido(c, size, fidoops::batch_for(size)));
        add(&tp, size, TCP, |b, c, size| b.host_vm_throughput_tcp(c, size));
        add(&tp, size, SERIAL, |b, c, size| b.host_vm_throughput_serial(c, size));
    }
    for &size in &SIZES {
        let lat = format!("vm-vm-latency-{}", size_label(size));
        add(&lat, size, FIDO, |b, c, size| b.vm_vm_latency_fido(c, size, "block"));
        add(&lat, size, FIDO_POLLED, |b, c, size| b.vm_vm_latency_fido(c, size, "poll"));
        add(&lat, size, TCP, |b, c, size| b.vm_vm_latency_tcp(c, size));
    }
    for &size in &SIZES {
        let tp = format!("vm-vm-throughput-{}", size_label(size));
        add(&tp, size, FIDO, |b, c, size| b.vm_vm_throughput_fido(c, size, 1));
        add(&tp, size, FIDO_BATCHED, |b, c, size| b.vm_vm_throughput_fido(c, size, fidoops::batch_for(size)));
        add(&tp, size, TCP, |b, c, size| b.vm_vm_throughput_tcp(c, size));
    }
    cases.retain(|(case, system, _)| {
        opts.wants(system, case) && (fido_on || !system.starts_with(FIDO))
    });

    let mut rows = Vec::new();
    let mut failures = Vec::new();
    for (case, system, f) in cases {
        if fido_demo::proc::interrupted() {
            break;
        }
        let t = Instant::now();
        match f(&mut bench) {
            Ok(r) => rows.push(r),
            Err(e) => {
                eprintln!("vm bench: {system} {case} FAILED: {e:#}");
                for vm in [&bench.a, &bench.b] {
                    eprintln!(
                        "vm bench: console of {} (last lines):\n{}",
                        vm.name,
                        vm.console_tail()
                    );
                }
                failures.push(format!("{system}/{case}"));
            }
        }
        eprintln!(
            "vm bench: {system} {case} ({:.1} s)",
            t.elapsed().as_secs_f64()
        );
    }
    let Bench { a, b, host, .. } = bench;
    let names = [a.name.clone(), b.name.clone()];
    drop(host);
    drop((a, b));
    drop(ns);
    // What crossed each VM's control path in the whole run (`fido vm run`
    // reports it when it stops): a handful of frames per case (join, offer,
    // connect, close), none per message.
    let control: Vec<String> = if fido_on {
        names
            .iter()
            .filter_map(|n| {
                let log = std::fs::read_to_string(dir.path().join(format!("{n}-qemu.log"))).ok()?;
                let l = log.lines().rev().find(|l| l.contains("(link: "))?;
                Some(format!("{n}: {}", &l[l.find("(link: ")?..]))
            })
            .collect()
    } else {
        Vec::new()
    };
    if let Some(br) = broker {
        std::thread::sleep(Duration::from_millis(400));
        br.stop()?;
    }
    fido_demo::proc::check_interrupt()?;

    // The table: one record per row, plus a bytes_copied record under each
    // Fido row (0 is the claim).
    let mut table = Vec::new();
    for r in &rows {
        table.push(r.record.clone());
        if let Some(c) = r.bytes_copied {
            table.push(Record {
                metric: "bytes_copied".into(),
                unit: "B".into(),
                value: c as f64,
                p50: None,
                p99: None,
                ..r.record.clone()
            });
        }
    }
    println!("{}", machine.header());
    crate::print_rows(&table);
    println!(
        "# vm: accel {} (every VM of the run), 2 VMs x 1 vCPU x {VM_MEM_MIB} MiB, {}; one_way_ns = RTT/2 \
         (host-vm: host clock, vm-vm: VM a's clock); throughput: VM -> host, VM a -> VM b, receiver folds every byte.",
        rig::accel().0,
        machine.extra["qemu"].as_str().unwrap_or("")
    );
    println!(
        "# guest CPU: -smp {} -cpu {} (fido vm run's, every guest of the run); throughput batching: the stream baselines \
         write through a {} KiB buffer (small messages many to a system call); fido: one descriptor per message; \
         fido-batched: {} KiB of messages per descriptor, each message written and folded whole.",
        rig::guest_smp(),
        rig::guest_cpu(),
        stream::STREAM_BUFFER >> 10,
        stream::STREAM_BUFFER >> 10
    );
    println!(
        "# virtio-net-tcp: tap on a bridge in a private network namespace (host at {}), vhost off, TCP_NODELAY \
         for latency, 4 MiB socket buffers for throughput, one connection; virtio-serial: a second \
         virtserialport, host end a Unix socket (host-vm only).",
        rig::HOST_ADDR
    );
    if !control.is_empty() {
        let messages: u64 = rows
            .iter()
            .filter(|r| r.record.system.starts_with(FIDO))
            .map(|r| r.record.n)
            .sum();
        println!(
            "# control path over the whole run ({messages} fido messages measured): {}",
            control.join("; ")
        );
    }
    if rows.iter().any(|r| r.record.system.starts_with(FIDO)) {
        for l in goal_lines(&rows) {
            println!("{l}");
        }
    } else {
        println!("# goals (throughput >= 5x, latency <= 0.5x virtio-net-tcp): not measured, fido did not run");
    }
    eprintln!(
        "({} records in {:.1} s)",
        rows.len(),
        t0.elapsed().as_secs_f64()
    );
    if let Some(p) = &opts.json {
        write_json(p, &rows, &machine)?;
    }
    if !failures.is_empty() {
        bail!("failed: {}", failures.join(", "));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(case: &str, system: &str, value: f64) -> Row {
        Row {
            record: Record::throughput(SUITE, case, system, value, 1),
            bytes_copied: None,
        }
    }

    #[test]
    fn goals_come_from_the_runs_own_ratios() {
        let rows = vec![
            row("host-vm-throughput-64B", FIDO, 600.0),
            row("host-vm-throughput-64B", TCP, 100.0),
            row("host-vm-latency-64B", FIDO, 60.0),
            row("host-vm-latency-64B", TCP, 100.0),
        ];
        let g = goal_lines(&rows);
        assert!(
            g.iter()
                .any(|l| l.contains("host-vm-throughput-64B: fido") && l.ends_with("6.00x met")),
            "{g:?}"
        );
        assert!(
            g.iter()
                .any(|l| l.contains("host-vm-latency-64B: fido ") && l.ends_with("0.60x NOT met")),
            "{g:?}"
        );
        assert!(g
            .iter()
            .any(|l| l.contains("host-vm-latency-64B: fido-polled") && l.contains("not measured")));
        assert!(
            !g.iter().any(|l| l.contains("vm-vm-throughput-4KiB")),
            "a case that did not run has no goal line"
        );
    }

    #[test]
    fn kv_parses_agent_lines() {
        let kv =
            Kv::parse("messages=12 checksum=34 timed_messages=11 timed_ns=5000".split_whitespace());
        let s = endpoint::parse_sink(&kv).unwrap();
        assert_eq!(
            (s.messages, s.checksum, s.timed_messages, s.timed_ns),
            (12, 34, 11, 5000)
        );
        assert!(Kv::parse(["n=x"].into_iter()).num::<u64>("n").is_err());
        assert!(Kv::parse(std::iter::empty()).get("n").is_err());
    }
}
