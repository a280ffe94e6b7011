//! `fido demo --vm`: the demo pipeline with both forwarders inside VMs —
//! source (host) → forwarder (VM 1) → forwarder (VM 2) → sink (host) — with
//! the checks of `fido demo` (order, checksum, the pointer unchanged through
//! every hop, 0 bytes copied in every domain, the guests' counters included),
//! then the same pipeline over virtio-net TCP between the same two VMs.
//!
//! How it runs, with nothing but the `fido` binary, QEMU and the test image
//! of `scripts/vm-image.sh`:
//!
//! * an embedded broker ([`EmbeddedBroker`]), as `fido demo` starts;
//! * two VMs, each a `fido vm run` child (its supervisor, which owns QEMU;
//!   both die with this process), booted in parallel with the image's kernel
//!   and initramfs. The guest's init runs the command given on the kernel
//!   command line (`fido.run=`): the two forwarder roles of this binary's
//!   `__demo-role`, one after the other, on the guest's serial console, which
//!   the demo reads (events are JSON lines, as from host roles) and writes
//!   (each role waits for a line before it starts: `gate=1`, so that a
//!   forwarder connects only once its downstream listens);
//! * the host roles (source and sink) as `fido demo` runs them.
//!
//! The TCP baseline gives each VM a virtio-net card on a tap, both taps on a
//! Linux bridge in a network namespace the demo creates (and deletes), where
//! the host's TCP roles run too: the fastest plain set-up, and nothing of
//! the machine's own network is touched. That needs root; otherwise it falls
//! back, saying so, to QEMU's user-mode network (each card behind QEMU's
//! own TCP/IP stack, a `hostfwd` from 127.0.0.1 to the guest's port, the
//! guest reaching the host's loopback at 10.0.2.2; `FIDO_DEMO_VM_NET=user`
//! chooses it as root too). Never an outside address.
//!
//! What it must never do: leave a VM running (each `fido vm run` child is
//! killed and reaped on every path, QEMU dies with it), or print a figure
//! from a guest that did not come in that guest's own result line.

use std::io::{BufRead as _, BufReader, Write as _};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use serde_json::Value;

use crate::demo::{bytes_str, dur_ns, gbps, print_fido, ratio, size_str};
use crate::pipeline::{self, Outcome, PingPhase, RoleReport, Spec};
use crate::proc::{self, EmbeddedBroker, Kid};
use crate::text::table;
use crate::uds::{self, Endpoint};

/// The guest's port its TCP forwarder listens on.
const GUEST_TCP_PORT: u16 = 7001;
/// The host as the guest sees it on QEMU's user-mode network.
const HOST_FROM_GUEST: &str = "10.0.2.2";
/// The guest's address on it (QEMU's default, where `hostfwd` delivers).
const GUEST_ADDR: &str = "10.0.2.15/24";
/// The bridge's subnet in the demo's network namespace: the host roles at
/// .1, VM i at .10+i. Private, and in a namespace with no other interface.
const BRIDGE_NET: &str = "10.77.0";
/// The TCP sink's port on the bridge.
const BRIDGE_SINK_PORT: u16 = 7000;
/// Ring entries per hop, as `fido demo`.
const RING_ENTRIES: u32 = 64;
/// How long two VMs may take to boot together (TCG on a loaded 2-core
/// machine: an idle one boots in ~8 s).
const BOOT_TIMEOUT: Duration = Duration::from_secs(180);
/// How long a role may take to report ready (a guest role under TCG included).
const READY_TIMEOUT: Duration = Duration::from_secs(60);
/// Console lines (not events) kept per VM, shown when something fails.
const TRANSCRIPT_LINES: usize = 40;

pub struct VmDemoArgs {
    pub seconds: f64,
    pub size: usize,
}

/// The test guest: what `scripts/vm-image.sh` wrote.
pub(crate) struct Image {
    pub(crate) dir: PathBuf,
    pub(crate) kernel: PathBuf,
    pub(crate) initrd: PathBuf,
    pub(crate) cmdline: String,
    /// What the script says is inside (`manifest`; empty if unreadable).
    pub(crate) manifest: String,
}

/// `FIDO_VM_IMAGE_DIR`, else `vm-image` beside this binary's profile
/// directory (`target/release/fido` → `target/vm-image`, where the script
/// writes it by default).
fn image_dir() -> anyhow::Result<PathBuf> {
    if let Some(d) = std::env::var_os("FIDO_VM_IMAGE_DIR").filter(|d| !d.is_empty()) {
        return Ok(PathBuf::from(d));
    }
    let exe = std::env::current_exe().context("current_exe")?;
    let profile = exe.parent().context("the fido binary has no directory")?;
    Ok(profile.parent().unwrap_or(profile).join("vm-image"))
}

/// Finds the image and, with `same_fido`, checks that its `/bin/fido` is
/// this binary (a guest that runs this binary's roles needs that: another
/// build may not speak them).
pub(crate) fn find_image(same_fido: bool) -> anyhow::Result<Image> {
    let dir = image_dir()?;
    let how = format!(
        "build it with `bash scripts/vm-image.sh --out {}` from the repository (it downloads Debian's kernel package with apt-get and packs this workspace's target/release/fido), or point FIDO_VM_IMAGE_DIR at one",
        dir.display()
    );
    let (kernel, initrd, cmdline) = (dir.join("kernel"), dir.join("initrd.img"), dir.join("cmdline"));
    for f in [&kernel, &initrd, &cmdline] {
        if !f.is_file() {
            bail!("no test guest image in {} ({} is missing): {how}", dir.display(), f.display());
        }
    }
    let cmdline = std::fs::read_to_string(&cmdline)
        .with_context(|| format!("reading {}", cmdline.display()))?
        .trim()
        .to_string();
    let manifest = std::fs::read_to_string(dir.join("manifest")).unwrap_or_default();
    let packed = manifest
        .lines()
        .find_map(|l| l.strip_prefix("fido: "))
        .and_then(|l| l.split_once(" sha256 "))
        .map(|(_, sum)| sum.trim().to_string());
    let exe = std::env::current_exe().context("current_exe")?;
    if let (true, Some(packed), Some(ours)) = (same_fido, packed, sha256_of(&exe)) {
        if packed != ours {
            bail!(
                "the test guest image in {} holds another fido binary than {} (sha256 {packed} ≠ {ours}): rebuild it with `scripts/vm-image.sh --fido {}`",
                dir.display(),
                exe.display(),
                exe.display()
            );
        }
    }
    Ok(Image {
        dir,
        kernel,
        initrd,
        cmdline,
        manifest,
    })
}

/// The file's SHA-256 by coreutils' `sha256sum` (`None` where it is missing:
/// the check is then skipped).
fn sha256_of(path: &Path) -> Option<String> {
    let out = std::process::Command::new("sha256sum").arg(path).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let s = String::from_utf8(out.stdout).ok()?;
    s.split_whitespace().next().map(str::to_string)
}

/// A free TCP port on 127.0.0.1 (bound and released: nobody else here asks
/// for it in the moment before QEMU or the sink binds it).
fn free_port() -> anyhow::Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").context("finding a free port")?;
    Ok(l.local_addr()?.port())
}

/// Runs `ip ARGS`, failing with its message.
fn ip(args: &[&str]) -> anyhow::Result<()> {
    let out = std::process::Command::new("ip")
        .args(args)
        .stdin(std::process::Stdio::null())
        .output()
        .context("running ip (iproute2)")?;
    if !out.status.success() {
        bail!("ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}

/// A network namespace of the demo's own holding a bridge: the VMs' taps
/// and the host's TCP roles live there, so nothing the demo does touches the
/// machine's own network. Deleted when dropped.
struct Netns {
    name: String,
}

impl Netns {
    fn create(name: &str) -> anyhow::Result<Netns> {
        ip(&["netns", "add", name])?;
        let ns = Netns { name: name.to_string() };
        let bridge_addr = format!("{BRIDGE_NET}.1/24");
        ip(&["-n", name, "link", "set", "lo", "up"])?;
        ip(&["-n", name, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", name, "addr", "add", &bridge_addr, "dev", "br0"])?;
        ip(&["-n", name, "link", "set", "br0", "up"])?;
        Ok(ns)
    }

    /// Puts a tap QEMU makes in the namespace on the bridge. QEMU makes its
    /// network devices after its console socket, so the tap may not be
    /// there yet: it is waited for.
    fn attach(&self, tap: &str) -> anyhow::Result<()> {
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            proc::check_interrupt()?;
            match ip(&["-n", &self.name, "link", "set", tap, "master", "br0"]) {
                Ok(()) => break,
                Err(e) if Instant::now() > deadline => return Err(e.context(format!("QEMU made no tap {tap}"))),
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        }
        ip(&["-n", &self.name, "link", "set", tap, "up"])
    }

    /// The command prefix that runs a program inside.
    fn wrapper(&self) -> Vec<String> {
        ["ip", "netns", "exec", &self.name].map(String::from).to_vec()
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        if let Err(e) = ip(&["netns", "del", &self.name]) {
            eprintln!("fido demo --vm: {e:#}");
        }
    }
}

/// How the TCP baseline's packets travel.
enum Net {
    /// A tap per VM on a bridge in a namespace of our own (needs root).
    Bridge(Netns),
    /// QEMU's user-mode network: 127.0.0.1:`ports[i]` forwarded to VM i's
    /// port, the sink on 127.0.0.1:`ports[2]`.
    User { ports: [u16; 3] },
}

impl Net {
    fn choose(run: u32) -> anyhow::Result<(Net, String)> {
        let why_not = if std::env::var("FIDO_DEMO_VM_NET").is_ok_and(|v| v == "user") {
            "FIDO_DEMO_VM_NET=user".to_string()
        } else if !rustix::process::getuid().is_root() {
            "not root".to_string()
        } else {
            match Netns::create(&format!("fido-demo-{run}")) {
                Ok(ns) => return Ok((Net::Bridge(ns), "a tap per VM on a bridge in a network namespace of the demo's own".into())),
                Err(e) => format!("{e:#}"),
            }
        };
        let ports = [free_port()?, free_port()?, free_port()?];
        Ok((Net::User { ports }, format!("QEMU's user-mode network (no tap on a bridge in a namespace of our own: {why_not})")))
    }

    /// Where host roles run.
    fn wrapper(&self) -> Vec<String> {
        match self {
            Net::Bridge(ns) => ns.wrapper(),
            Net::User { .. } => Vec::new(),
        }
    }

    /// VM `i`'s (0 or 1) address, `fido vm run` options and its wrapper.
    fn vm(&self, i: usize) -> (String, Vec<String>) {
        match self {
            Net::Bridge(_) => (
                format!("{BRIDGE_NET}.{}/24", 11 + i),
                vec![
                    "--".into(),
                    "-netdev".into(),
                    format!("tap,id=demo-net,ifname={},script=no,downscript=no", Self::tap(i)),
                    "-device".into(),
                    format!("virtio-net-pci,netdev=demo-net,mac=52:54:00:fd:00:{:02x},romfile=", i + 1),
                ],
            ),
            Net::User { ports } => (GUEST_ADDR.into(), vec!["--nic".into(), format!("user:{}-{GUEST_TCP_PORT}", ports[i])]),
        }
    }

    fn tap(i: usize) -> String {
        format!("demotap{}", i + 1)
    }

    /// Where VM `i`'s forwarder connects (the next VM, or the sink).
    fn downstream_of_vm(&self, i: usize) -> Endpoint {
        Endpoint::Tcp(match (self, i) {
            (Net::Bridge(_), 0) => format!("{BRIDGE_NET}.12:{GUEST_TCP_PORT}"),
            (Net::Bridge(_), _) => format!("{BRIDGE_NET}.1:{BRIDGE_SINK_PORT}"),
            (Net::User { ports }, i) => format!("{HOST_FROM_GUEST}:{}", ports[i + 1]),
        })
    }

    /// Where the source connects (VM 1's forwarder).
    fn source_down(&self) -> Endpoint {
        Endpoint::Tcp(match self {
            Net::Bridge(_) => format!("{BRIDGE_NET}.11:{GUEST_TCP_PORT}"),
            Net::User { ports } => format!("127.0.0.1:{}", ports[0]),
        })
    }

    /// Where the sink listens.
    fn sink_up(&self) -> Endpoint {
        Endpoint::Tcp(match self {
            Net::Bridge(_) => format!("{BRIDGE_NET}.1:{BRIDGE_SINK_PORT}"),
            Net::User { ports } => format!("127.0.0.1:{}", ports[2]),
        })
    }

    fn describe_path(&self) -> &'static str {
        match self {
            Net::Bridge(_) => "its virtio-net card, a tap and a Linux bridge (in the demo's network namespace)",
            Net::User { .. } => "its virtio-net card and QEMU's user-mode network (to 10.0.2.2 = the host's loopback, where QEMU forwards to the next VM)",
        }
    }
}

/// A console line, or the console closing (`None`).
type Line = Option<String>;

/// One VM running this demo's forwarder roles (or `fido demo --blk`'s
/// guest script): its `fido vm run` child and its serial console.
pub(crate) struct GuestVm {
    name: String,
    supervisor: Kid,
    console: UnixStream,
    lines: mpsc::Receiver<Line>,
    /// The last console lines that were not events (what the guest said).
    transcript: std::collections::VecDeque<String>,
    closed: bool,
}

impl GuestVm {
    /// Starts `fido vm run NAME` with the image (through `wrapper`), running
    /// `script` in the guest, its console on a socket in `dir`, its network
    /// as `net` says for VM `index`.
    fn boot(
        name: &str,
        image: &Image,
        script: &str,
        dir: &Path,
        broker: &Path,
        net: &Net,
        index: usize,
    ) -> anyhow::Result<GuestVm> {
        let (guest_addr, net_args) = net.vm(index);
        let params = format!("fido.hostname={name} fido.ip={guest_addr} fido.run=\"{script}\"");
        Self::start(name, image, &params, dir, broker, &net.wrapper(), net_args)
    }

    /// Starts `fido vm run NAME` with the image (through `wrapper`), the
    /// image's kernel command line followed by `params`, its console on a
    /// socket in `dir`, and `extra` arguments of `fido vm run` (QEMU's after
    /// a `--`).
    pub(crate) fn start(
        name: &str,
        image: &Image,
        params: &str,
        dir: &Path,
        broker: &Path,
        wrapper: &[String],
        extra: Vec<String>,
    ) -> anyhow::Result<GuestVm> {
        let console_path = dir.join(format!("{name}.console"));
        let append = format!("{} {params}", image.cmdline);
        let path = |p: &Path| p.display().to_string();
        let args = vec![
            "vm".to_string(),
            "run".into(),
            name.into(),
            "--kernel".into(),
            path(&image.kernel),
            "--initrd".into(),
            path(&image.initrd),
            "--append".into(),
            append,
            "--console".into(),
            path(&console_path),
            "--socket".into(),
            path(broker),
        ];
        let args: Vec<String> = args.into_iter().chain(extra).collect();
        let supervisor = Kid::spawn_wrapped(wrapper, &args, Some(broker))?;
        Self::attach(name, supervisor, &console_path, "`fido vm run`")
    }

    /// Starts QEMU itself (not a Fido VM domain: no arena, no doorbells,
    /// no broker) with the image, the image's kernel command line followed
    /// by `params`, `memory_mib` of RAM, its console on a socket in `dir`,
    /// and `extra` QEMU arguments; under TCG, as the tests' plain guests.
    /// QEMU runs under `setpriv --pdeathsig KILL` (util-linux): it dies
    /// with this process.
    pub(crate) fn start_qemu(
        name: &str,
        image: &Image,
        params: &str,
        dir: &Path,
        memory_mib: u32,
        extra: &[String],
    ) -> anyhow::Result<GuestVm> {
        let console_path = dir.join(format!("{name}.console"));
        let path = |p: &Path| p.display().to_string();
        let mut args: Vec<String> = [
            "--pdeathsig",
            "KILL",
            "--",
            "qemu-system-x86_64",
            "-name",
            name,
            "-machine",
            "q35",
            "-accel",
            "tcg,thread=multi",
            "-cpu",
            fido_vm::qemu::TCG_CPU,
            "-nographic",
            "-nodefaults",
            "-no-user-config",
            "-no-reboot",
            "-device",
            "intel-iommu,intremap=on",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        args.extend([
            "-m".into(),
            format!("{memory_mib}M"),
            "-smp".into(),
            fido_vm::qemu::tcg_smp(1),
            "-chardev".into(),
            format!("socket,id=console,path={},server=on,wait=off", path(&console_path)),
            "-serial".into(),
            "chardev:console".into(),
            "-kernel".into(),
            path(&image.kernel),
            "-initrd".into(),
            path(&image.initrd),
            "-append".into(),
            format!("{} {params}", image.cmdline),
        ]);
        args.extend(extra.iter().cloned());
        let qemu = Kid::spawn_program("setpriv", &args)
            .context("starting QEMU under setpriv --pdeathsig KILL (setpriv is util-linux's)")?;
        Self::attach(name, qemu, &console_path, "QEMU")
    }

    /// Connects to the console of the VM `supervisor` (`what`) starts.
    fn attach(name: &str, mut supervisor: Kid, console_path: &Path, what: &str) -> anyhow::Result<GuestVm> {
        // QEMU makes the console socket as it starts; the kernel prints
        // nothing we need for seconds after that.
        let deadline = Instant::now() + READY_TIMEOUT;
        let console = loop {
            proc::check_interrupt()?;
            if let Ok(s) = UnixStream::connect(console_path) {
                break s;
            }
            if let Some(st) = supervisor.exited() {
                bail!("VM {name}: {what} exited ({st}) before its console opened (its messages are above)");
            }
            if Instant::now() > deadline {
                bail!("VM {name}: no console at {} after {READY_TIMEOUT:?}", console_path.display());
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let reader = console.try_clone().context("cloning the console socket")?;
        let (tx, rx) = mpsc::channel();
        std::thread::Builder::new()
            .name(format!("console-{name}"))
            .spawn(move || {
                let mut r = BufReader::new(reader);
                loop {
                    let mut raw = Vec::new();
                    let line = match r.read_until(b'\n', &mut raw) {
                        Ok(0) | Err(_) => None,
                        Ok(_) => Some(String::from_utf8_lossy(&raw).trim().to_string()),
                    };
                    let end = line.is_none();
                    if tx.send(line).is_err() || end {
                        return;
                    }
                }
            })
            .context("starting the console reader")?;
        Ok(GuestVm {
            name: name.to_string(),
            supervisor,
            console,
            lines: rx,
            transcript: Default::default(),
            closed: false,
        })
    }

    /// What the guest printed lately, for an error message.
    pub(crate) fn said(&self) -> String {
        if self.transcript.is_empty() {
            return String::new();
        }
        let lines: Vec<&str> = self.transcript.iter().map(|s| s.as_str()).collect();
        format!("\n  VM {} console (last lines):\n    {}", self.name, lines.join("\n    "))
    }

    /// Waits for an event line `{"event":EVENT,...}` on the console until
    /// `deadline`; any other event is an error (a role failed and the next
    /// started), other lines are kept as the transcript.
    fn expect_event(&mut self, event: &str, deadline: Instant) -> anyhow::Result<Value> {
        loop {
            proc::check_interrupt()?;
            if self.closed {
                bail!("VM {}: the console closed before a `{event}` event{}", self.name, self.said());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                bail!("VM {}: no `{event}` event in time{}", self.name, self.said());
            }
            let line = match self.lines.recv_timeout(left.min(Duration::from_millis(50))) {
                Ok(Some(line)) => line,
                Ok(None) | Err(mpsc::RecvTimeoutError::Disconnected) => {
                    self.closed = true;
                    continue;
                }
                Err(mpsc::RecvTimeoutError::Timeout) => continue,
            };
            // A kernel message may precede an event on its line.
            let parsed = line
                .find('{')
                .and_then(|at| serde_json::from_str::<Value>(&line[at..]).ok())
                .filter(|v| v.get("event").is_some_and(Value::is_string));
            match parsed {
                Some(v) if v["event"] == event => return Ok(v),
                Some(v) => bail!("VM {}: expected a `{event}` event, got {v}{}", self.name, self.said()),
                None => {
                    if !line.is_empty() {
                        if self.transcript.len() == TRANSCRIPT_LINES {
                            self.transcript.pop_front();
                        }
                        self.transcript.push_back(line);
                    }
                }
            }
        }
    }

    /// Lets the role that printed `waiting` start (`gate=1`).
    fn go(&mut self) -> anyhow::Result<()> {
        self.send(b"go\n")
    }

    /// Writes `bytes` to the guest's console (its input).
    pub(crate) fn send(&mut self, bytes: &[u8]) -> anyhow::Result<()> {
        self.console
            .write_all(bytes)
            .with_context(|| format!("VM {}: writing to its console", self.name))
    }

    /// The next event line (`{"event":...}`, any event) if one comes within
    /// `wait`, else `None`; other lines are kept as the transcript. Fails
    /// when the console closed or on interrupt.
    pub(crate) fn poll_event(&mut self, wait: Duration) -> anyhow::Result<Option<Value>> {
        let until = Instant::now() + wait;
        loop {
            proc::check_interrupt()?;
            if self.closed {
                bail!("VM {}: the console closed{}", self.name, self.said());
            }
            let left = until.saturating_duration_since(Instant::now());
            let line = match self.lines.recv_timeout(left.min(Duration::from_millis(50))) {
                Ok(Some(line)) => line,
                Ok(None) | Err(mpsc::RecvTimeoutError::Disconnected) => {
                    self.closed = true;
                    continue;
                }
                Err(mpsc::RecvTimeoutError::Timeout) if left.is_zero() => return Ok(None),
                Err(mpsc::RecvTimeoutError::Timeout) => continue,
            };
            let parsed = line
                .find('{')
                .and_then(|at| serde_json::from_str::<Value>(&line[at..]).ok())
                .filter(|v| v.get("event").is_some_and(Value::is_string));
            match parsed {
                Some(v) => return Ok(Some(v)),
                None if line.is_empty() => {}
                None => {
                    if self.transcript.len() == TRANSCRIPT_LINES {
                        self.transcript.pop_front();
                    }
                    self.transcript.push_back(line);
                }
            }
        }
    }


    /// Waits for the guest to power off (its script ends) and its supervisor
    /// to exit successfully.
    pub(crate) fn finish(self, timeout: Duration) -> anyhow::Result<()> {
        let name = self.name.clone();
        self.supervisor
            .finish(timeout)
            .map(|_| ())
            .with_context(|| format!("VM {name}"))
    }
}

/// GB/s with the digits a slow transport needs (TCP under TCG moves tens
/// of MB/s).
fn rate(bytes_per_s: f64) -> String {
    if bytes_per_s < 1e8 {
        format!("{:.4}", bytes_per_s / 1e9)
    } else {
        gbps(bytes_per_s)
    }
}

/// A role's arguments for `__demo-role`.
fn role(args: &[String]) -> Vec<String> {
    std::iter::once("__demo-role".to_string())
        .chain(args.iter().cloned())
        .collect()
}

/// The shell command a guest runs: its Fido forwarder, then its TCP one.
fn guest_script(fido: &[String], tcp: &[String]) -> String {
    let cmd = |a: &[String]| format!("/bin/fido __demo-role gate=1 {}", a.join(" "));
    format!("{}; {}", cmd(fido), cmd(tcp))
}

/// Runs `fido demo --vm`; `Ok(false)` when a check failed.
pub fn run(a: VmDemoArgs) -> anyhow::Result<bool> {
    proc::install_interrupt_flag()?;
    if a.size < pipeline::HEADER {
        bail!("--size must be at least {} bytes (the message header)", pipeline::HEADER);
    }
    if !(a.seconds > 0.0 && a.seconds <= 600.0) {
        bail!("--seconds must be in (0, 600] with --vm");
    }
    if !crate::vm::have_qemu() {
        bail!("qemu-system-x86_64 is not on PATH: `fido demo --vm` runs its forwarders in QEMU guests (Debian: apt-get install qemu-system-x86)");
    }
    let image = find_image(true)?;
    let duration = Duration::from_secs_f64(a.seconds);
    let warmup = (duration / 4).min(Duration::from_millis(500));
    let pings = PingPhase {
        duration: (duration / 4).clamp(Duration::from_millis(100), Duration::from_secs(2)),
        min_pings: 100,
        max_pings: 100_000,
    };
    let spec = Spec {
        links: 3,
        size: a.size,
        warmup,
        duration,
        ring_entries: RING_ENTRIES,
        launcher: vec!["__demo-role".into()],
        prefix: "vmdemo".into(),
    };

    let broker = EmbeddedBroker::start("fido-demo-vm-")?;
    let broker_path = broker.socket().to_path_buf();
    say!("broker: embedded, at {}", broker_path.display());
    let dir = tempfile::Builder::new()
        .prefix("fido-demo-vm-")
        .tempdir()
        .context("creating a temporary directory")?;

    // Names of this run: the VMs' (their records are per user) and the
    // pipeline's services (the broker is ours, but say whose they are).
    let run = std::process::id();
    let vm_names = [format!("demo-vm1-{run}"), format!("demo-vm2-{run}")];
    let svc = |label: &str| format!("vmdemo-{label}-{run}");
    let common = |r: &str, label: &str| {
        vec![
            format!("role={r}"),
            format!("entries={RING_ENTRIES}"),
            format!("name=vmdemo-{label}"),
        ]
    };
    let mut sink_fido = common("sink", "sink");
    sink_fido.extend([format!("listen={}", svc("sink")), format!("ack={}", svc("ack"))]);
    let mut fwd2_fido = common("fwd", "fwd2");
    fwd2_fido.extend([format!("listen={}", svc("fwd2")), format!("next={}", svc("sink"))]);
    let mut fwd1_fido = common("fwd", "fwd1");
    fwd1_fido.extend([format!("listen={}", svc("fwd1")), format!("next={}", svc("fwd2"))]);
    let mut source_fido = common("source", "source");
    source_fido.extend([
        format!("next={}", svc("fwd1")),
        format!("size={}", a.size),
        format!("warm_ns={}", warmup.as_nanos()),
        format!("dur_ns={}", duration.as_nanos()),
        format!("ack={}", svc("ack")),
        "arena_pow2=1".into(),
    ]);
    source_fido.extend(pings.args());

    let (net, net_why) = Net::choose(run)?;
    let guest_listen = Endpoint::Tcp(format!("0.0.0.0:{GUEST_TCP_PORT}"));
    let fwd1_tcp = uds::forwarder_args(&spec, &guest_listen, &net.downstream_of_vm(0));
    let fwd2_tcp = uds::forwarder_args(&spec, &guest_listen, &net.downstream_of_vm(1));
    let tcp_ack = Endpoint::Unix(dir.path().join("ack.sock"));
    let sink_tcp = uds::sink_args(&spec, &net.sink_up(), Some(tcp_ack.clone()));
    let source_tcp = uds::source_args(&spec, &net.source_down(), Some((&pings, tcp_ack)));

    say!(
        "fido demo --vm: source (host) → fwd1 (VM {}) → fwd2 (VM {}) → sink (host), {} messages, {:.1} s measured after {:.2} s warm-up",
        vm_names[0],
        vm_names[1],
        size_str(a.size),
        duration.as_secs_f64(),
        warmup.as_secs_f64(),
    );
    say!(
        "  throughput: {:.1} s at full load; then latency: one message in flight for {:.2} s (at least {} messages); first over Fido, then over virtio-net TCP",
        duration.as_secs_f64(),
        pings.duration.as_secs_f64(),
        pings.min_pings,
    );
    let t0 = Instant::now();
    say!("booting the two VMs (the accelerator `fido vm run` chose is on the lines it prints)...");
    say!("  TCP network: {net_why}");
    let mut vm1 = GuestVm::boot(&vm_names[0], &image, &guest_script(&fwd1_fido, &fwd1_tcp), dir.path(), &broker_path, &net, 0)?;
    let mut vm2 = GuestVm::boot(&vm_names[1], &image, &guest_script(&fwd2_fido, &fwd2_tcp), dir.path(), &broker_path, &net, 1)?;
    if let Net::Bridge(ns) = &net {
        // QEMU made its tap as it started (the consoles are up).
        ns.attach(&Net::tap(0))?;
        ns.attach(&Net::tap(1))?;
    }
    let boot_by = Instant::now() + BOOT_TIMEOUT;
    vm1.expect_event("waiting", boot_by)?;
    vm2.expect_event("waiting", boot_by)?;
    say!("both guests up in {:.1} s", t0.elapsed().as_secs_f64());

    // ---- Fido: sink, fwd2, fwd1 (downstream first), then the source.
    let ready_by = || Instant::now() + READY_TIMEOUT;
    let mut sink = Kid::spawn(&role(&sink_fido), &broker_path)?;
    sink.expect_event("ready", ready_by())?;
    vm2.go()?;
    let fwd2_ready = vm2.expect_event("ready", ready_by())?;
    vm1.go()?;
    let fwd1_ready = vm1.expect_event("ready", ready_by())?;
    let mut source = Kid::spawn(&role(&source_fido), &broker_path)?;
    source.expect_event("ready", ready_by())?;
    let results_by = Instant::now() + warmup + duration + pings.duration + Duration::from_secs(120);
    let source_result = source.expect_event("result", results_by)?;
    let fwd1_result = vm1.expect_event("result", results_by)?;
    let fwd2_result = vm2.expect_event("result", results_by)?;
    let sink_result = sink.expect_event("result", results_by)?;
    let report = |label: String, pid: u32, v: Value| RoleReport { label, pid, v };
    let guest_pid = |v: &Value| v["pid"].as_u64().unwrap_or(0) as u32;
    let fido = Outcome {
        roles: vec![
            report("source (host)".into(), source.pid(), source_result),
            report(format!("fwd1 (VM {})", vm_names[0]), guest_pid(&fwd1_ready), fwd1_result),
            report(format!("fwd2 (VM {})", vm_names[1]), guest_pid(&fwd2_ready), fwd2_result),
            report("sink (host)".into(), sink.pid(), sink_result),
        ],
    };
    proc::finish_all(vec![source, sink], Duration::from_secs(10))?;

    // ---- TCP over virtio-net, between the same VMs.
    let host_tcp = HostRoles { sink: sink_tcp, source: source_tcp, wrapper: net.wrapper() };
    let tcp = run_tcp(&spec, &pings, [&mut vm1, &mut vm2], &host_tcp, &vm_names);
    proc::check_interrupt()?;
    let powered_off = if tcp.is_err() {
        // The guests may still wait in a role; they go with their supervisors.
        drop((vm1, vm2));
        Err(anyhow::anyhow!("stopped (killed) after the TCP comparison failed"))
    } else {
        // Their scripts are done: the guests power off.
        let first = vm1.finish(Duration::from_secs(60));
        let second = vm2.finish(Duration::from_secs(60));
        first.and(second)
    };
    broker.stop()?;
    let net_path = net.describe_path();
    drop(net);
    dir.close().context("removing the demo's temporary directory")?;
    let elapsed = t0.elapsed();

    print_fido(&fido, RING_ENTRIES);
    let s = fido.sink();
    let (fido_bps, fido_mps) = (s.f(&["window", "bytes_per_s"]), s.f(&["window", "msgs_per_s"]));
    let (fp50, fp99) = (s.f(&["ping_p50_ns"]), s.f(&["ping_p99_ns"]));
    let mut rows = vec![vec![
        "fido".to_string(),
        rate(fido_bps),
        format!("{fido_mps:.0}"),
        dur_ns(fp50),
        dur_ns(fp99),
        fido.bytes_copied().to_string(),
    ]];
    if let Ok(t) = &tcp {
        let ts = t.sink();
        let (bps, mps) = (ts.f(&["window", "bytes_per_s"]), ts.f(&["window", "msgs_per_s"]));
        let (p50, p99) = (ts.f(&["ping_p50_ns"]), ts.f(&["ping_p99_ns"]));
        rows.push(vec![
            "virtio-net TCP".into(),
            rate(bps),
            format!("{mps:.0}"),
            dur_ns(p50),
            dur_ns(p99),
            "not counted (every hop copies: socket, virtio ring, QEMU's network stack)".into(),
        ]);
        rows.push(vec![
            "fido / TCP".into(),
            ratio(fido_bps, bps),
            ratio(fido_mps, mps),
            ratio(fp50, p50),
            ratio(fp99, p99),
            String::new(),
        ]);
    }
    if let Err(e) = &tcp {
        eprintln!("fido demo --vm: the TCP comparison failed: {e:#}");
    }
    say!("\nsource (host) → fwd1 (VM) → fwd2 (VM) → sink (host), 3 hops, {} messages:", size_str(a.size));
    say_raw!(
        "{}",
        table(
            &["system", "GB/s at sink", "msgs/s", "latency p50", "latency p99", "bytes copied"],
            &rows
        )
    );
    say!("(fido / TCP: above 1 means fido moves more for GB/s and msgs/s; below 1 means fido is quicker for latency)");
    say!(
        "(fido: each guest maps its upstream's arena read-only (a hot-plugged PCI BAR) and forwards the message's pointer; doorbells are ivshmem interrupts. TCP: each guest's forwarder reads every message from one connection and writes it to the next over {}, TCP_NODELAY, kernel-tuned buffers ({} SO_SNDBUF at the source))",
        net_path,
        tcp.as_ref().ok().map(|t| bytes_str(t.source().u(&["sndbuf"]))).unwrap_or_else(|| "-".into()),
    );
    say!(
        "(throughput: the source sends as fast as the pipeline takes messages, fido holding up to {RING_ENTRIES} messages per hop (its ring), TCP what its buffers hold; latency: one message in flight, from the source stamping a message to the sink having read and checked every byte, on the host's clock; fido {} and TCP {} messages)",
        s.u(&["ping_samples"]),
        tcp.as_ref().map_or(0, |t| t.sink().u(&["ping_samples"])),
    );

    say!("\nchecks:");
    let mut checks = fido.checks();
    match &tcp {
        Ok(t) => checks.extend(
            t.delivery_checks()
                .into_iter()
                .map(|(what, ok, detail)| (format!("TCP {what}"), ok, detail)),
        ),
        Err(e) => checks.push(("TCP comparison".into(), false, format!("{e:#}"))),
    }
    checks.push((
        "VMs powered off".into(),
        powered_off.is_ok(),
        match &powered_off {
            Ok(()) => "both guests ended their scripts and powered off; their supervisors exited cleanly".into(),
            Err(e) => format!("{e:#}"),
        },
    ));
    for (what, ok, detail) in &checks {
        say!("  [{}] {what}: {detail}", if *ok { " ok " } else { "FAIL" });
    }
    let ok = checks.iter().all(|(_, ok, _)| *ok);
    say!(
        "VMs {} and {} gone, broker stopped ({:.1} s in all)",
        vm_names[0],
        vm_names[1],
        elapsed.as_secs_f64()
    );
    say!("result: {}", if ok { "PASS" } else { "FAIL" });
    Ok(ok)
}

/// The host's roles of the TCP pipeline and where they run.
struct HostRoles {
    sink: Vec<String>,
    source: Vec<String>,
    /// `ip netns exec NS` when they run in the demo's namespace.
    wrapper: Vec<String>,
}

/// The TCP pipeline: the host sink, the guests' TCP forwarders (downstream
/// first), the host source; every result collected, the host roles reaped.
fn run_tcp(
    spec: &Spec,
    pings: &PingPhase,
    [vm1, vm2]: [&mut GuestVm; 2],
    host: &HostRoles,
    vm_names: &[String; 2],
) -> anyhow::Result<Outcome> {
    let HostRoles { sink: sink_args, source: source_args, wrapper } = host;
    let ready_by = || Instant::now() + READY_TIMEOUT;
    let mut sink = Kid::spawn_wrapped(wrapper, &role(sink_args), None)?;
    sink.expect_event("ready", ready_by())?;
    vm2.expect_event("waiting", ready_by())?;
    vm2.go()?;
    let fwd2_ready = vm2.expect_event("ready", ready_by())?;
    vm1.expect_event("waiting", ready_by())?;
    vm1.go()?;
    let fwd1_ready = vm1.expect_event("ready", ready_by())?;
    let mut source = Kid::spawn_wrapped(wrapper, &role(source_args), None)?;
    source.expect_event("ready", ready_by())?;
    let results_by = Instant::now() + spec.warmup + spec.duration + pings.duration + Duration::from_secs(120);
    let source_result = source.expect_event("result", results_by)?;
    let fwd1_result = vm1.expect_event("result", results_by)?;
    let fwd2_result = vm2.expect_event("result", results_by)?;
    let sink_result = sink.expect_event("result", results_by)?;
    let guest_pid = |v: &Value| v["pid"].as_u64().unwrap_or(0) as u32;
    let roles = vec![
        RoleReport { label: "source (host)".into(), pid: source.pid(), v: source_result },
        RoleReport { label: format!("fwd1 (VM {})", vm_names[0]), pid: guest_pid(&fwd1_ready), v: fwd1_result },
        RoleReport { label: format!("fwd2 (VM {})", vm_names[1]), pid: guest_pid(&fwd2_ready), v: fwd2_result },
        RoleReport { label: "sink (host)".into(), pid: sink.pid(), v: sink_result },
    ];
    proc::finish_all(vec![source, sink], Duration::from_secs(10))?;
    Ok(Outcome { roles })
}

/// Whether `qemu-system-x86_64` is on PATH.
pub fn have_qemu() -> bool {
    std::env::var_os("PATH").is_some_and(|paths| {
        std::env::split_paths(&paths).any(|d| d.join("qemu-system-x86_64").is_file())
    })
}
