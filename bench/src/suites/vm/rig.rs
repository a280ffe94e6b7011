//! The `vm` suite's machinery on the host: the test guest image with this
//! binary in it, a private network namespace (a bridge, one tap per VM, the
//! host's address on the bridge), the VMs themselves (each booted once per
//! suite run) and the line protocol to each guest's agent
//! ([`super::endpoint`]).
//!
//! Everything it creates it removes: QEMU processes are killed by their pid
//! and reaped, the namespace is deleted (with its bridge and taps), the
//! temporary directory goes; also when a step fails.

use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};

use super::endpoint::{Kv, CTL_PORT, SERIAL_PORT};

/// The bridge's subnet: the host is .1, VM `i` is .(11 + i).
pub const HOST_ADDR: &str = "10.77.0.1";
const BRIDGE: &str = "fbbr0";

/// The QEMU accelerator every VM of a run uses (one for all systems), and
/// why: `fido vm`'s detection (KVM when /dev/kvm can boot a stock guest, TCG
/// otherwise; `FIDO_VM_ACCEL=kvm|tcg` overrides), decided once per run.
pub fn accel() -> &'static (&'static str, String) {
    static ACCEL: std::sync::OnceLock<(&'static str, String)> = std::sync::OnceLock::new();
    ACCEL.get_or_init(|| {
        let (a, why) = fido_vm::qemu::choose_accel(None);
        let name = match a {
            fido_vm::qemu::Accel::Kvm => "kvm",
            fido_vm::qemu::Accel::Tcg => "tcg",
        };
        (name, why)
    })
}

/// The `-cpu` of a baseline guest: what `fido vm run` gives its guests under
/// the same accelerator (`host` under KVM, [`fido_vm::qemu::TCG_CPU`] under
/// TCG), so Fido's guests and the baselines' run the same CPU model.
pub fn guest_cpu() -> &'static str {
    if accel().0 == "kvm" {
        "host"
    } else {
        fido_vm::qemu::TCG_CPU
    }
}

/// The `-smp` of a one-vCPU baseline guest: as `fido vm run` gives its guests
/// (two possible CPUs under TCG, [`fido_vm::qemu::tcg_smp`], without which
/// QEMU drops the guest's memory barriers, those of its virtio rings too).
pub fn guest_smp() -> String {
    if accel().0 == "kvm" {
        "1".into()
    } else {
        fido_vm::qemu::tcg_smp(1)
    }
}

fn run_ok(cmd: &mut Command) -> anyhow::Result<()> {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{cmd:?} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// The test guest (scripts/vm-image.sh) with this binary at /bin/fido-bench.
pub struct Image {
    pub kernel: PathBuf,
    pub initrd: PathBuf,
    pub cmdline: String,
}

/// The workspace root: `$FIDO_REPO`, else two levels above this executable
/// (`target/release/fido-bench`).
pub(crate) fn repo_root() -> anyhow::Result<PathBuf> {
    if let Some(p) = std::env::var_os("FIDO_REPO") {
        return Ok(PathBuf::from(p));
    }
    let exe = std::env::current_exe()?;
    exe.ancestors()
        .find(|a| a.join("scripts/vm-image.sh").is_file())
        .map(Path::to_path_buf)
        .context(
            "scripts/vm-image.sh not found above this executable; set FIDO_REPO to the workspace",
        )
}

/// Builds (or finds cached) the image: this executable, stripped of debug
/// info, added as /bin/fido-bench (the script copies its shared libraries).
pub fn build_image() -> anyhow::Result<Image> {
    let root = repo_root()?;
    let out = std::env::var_os("FIDO_BENCH_VM_IMAGE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target/vm-image-bench"));
    std::fs::create_dir_all(&out)?;
    let stripped = out.join("fido-bench.bin");
    run_ok(
        Command::new("strip")
            .arg("--strip-debug")
            .arg("-o")
            .arg(&stripped)
            .arg(std::env::current_exe()?),
    )
    .context("strip (binutils) is needed to put fido-bench into the guest")?;
    let mut c = Command::new(root.join("scripts/vm-image.sh"));
    c.arg("--out")
        .arg(&out)
        .arg("--add")
        .arg(format!("{}:/bin/fido-bench", stripped.display()))
        .arg("--quiet")
        .current_dir(&root);
    // The kernel package and its extraction are the script's shared cache
    // (target/vm-image-cache beside the tests' image): no second download.
    let mut status = c
        .stdin(Stdio::null())
        .status()
        .context("running scripts/vm-image.sh")?;
    if !status.success() && out.join("kernel").exists() {
        // The script hard-links its cached kernel into each image, and a
        // rebuild that keeps the kernel then fails to `mv` the link onto
        // itself ("are the same file"); without the old link it succeeds.
        eprintln!("vm bench: rebuilding the image without its old kernel link");
        std::fs::remove_file(out.join("kernel"))?;
        status = c.status().context("running scripts/vm-image.sh")?;
    }
    if !status.success() {
        bail!("scripts/vm-image.sh failed ({status})");
    }
    Ok(Image {
        kernel: out.join("kernel"),
        initrd: out.join("initrd.img"),
        cmdline: std::fs::read_to_string(out.join("cmdline"))?
            .trim()
            .to_string(),
    })
}

/// A network namespace of our own with a bridge (the host's address on it)
/// and one tap per VM: virtio-net between VMs and to the host crosses only
/// this bridge. Deleted (with everything in it) on drop.
pub struct Netns {
    pub name: String,
    handle: File,
}

impl Netns {
    pub fn create() -> anyhow::Result<Netns> {
        let name = format!("fido-bench-{}", std::process::id());
        run_ok(Command::new("ip").args(["netns", "add", &name]))
            .context("creating a network namespace (the vm suite needs root)")?;
        let handle = match File::open(format!("/run/netns/{name}")) {
            Ok(f) => f,
            Err(e) => {
                let _ = run_ok(Command::new("ip").args(["netns", "del", &name]));
                return Err(e.into());
            }
        };
        let ns = Netns { name, handle };
        let n = ns.name.as_str();
        for args in [
            vec!["-n", n, "link", "set", "lo", "up"],
            vec!["-n", n, "link", "add", BRIDGE, "type", "bridge"],
            vec![
                "-n",
                n,
                "addr",
                "add",
                &format!("{HOST_ADDR}/24"),
                "dev",
                BRIDGE,
            ],
            vec!["-n", n, "link", "set", BRIDGE, "up"],
        ] {
            run_ok(Command::new("ip").args(&args))?;
        }
        Ok(ns)
    }

    /// A tap on the bridge, for one VM's virtio-net.
    pub fn add_tap(&self, tap: &str) -> anyhow::Result<()> {
        let n = self.name.as_str();
        run_ok(Command::new("ip").args([
            "-n", n, "tuntap", "add", "dev", tap, "mode", "tap", "vnet_hdr",
        ]))?;
        run_ok(Command::new("ip").args(["-n", n, "link", "set", tap, "master", BRIDGE]))?;
        run_ok(Command::new("ip").args(["-n", n, "link", "set", tap, "up"]))
    }

    /// Runs `f` on a thread that has entered the namespace (a thread's
    /// network namespace is its own: the rest of the process stays outside).
    pub fn run<T: Send>(&self, f: impl FnOnce() -> anyhow::Result<T> + Send) -> anyhow::Result<T> {
        let fd = self.handle.as_fd();
        std::thread::scope(|s| {
            s.spawn(move || {
                rustix::thread::move_into_link_name_space(
                    fd,
                    Some(rustix::thread::LinkNameSpaceType::Network),
                )
                .context("entering the bench's network namespace")?;
                f()
            })
            .join()
            .map_err(|_| anyhow::anyhow!("a bench thread panicked"))?
        })
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        if let Err(e) = run_ok(Command::new("ip").args(["netns", "del", &self.name])) {
            eprintln!("vm bench: removing network namespace {}: {e:#}", self.name);
        }
    }
}

/// How the VMs are started.
pub enum Launcher {
    /// QEMU directly (the baselines need nothing else).
    Qemu,
    /// `fido vm run` (the VM is a Fido domain; the baselines run beside Fido
    /// in the same VMs): `fido` is the CLI, `broker` its broker's socket.
    FidoVm { fido: PathBuf, broker: PathBuf },
}

/// The line protocol to a guest's agent over its [`CTL_PORT`].
pub struct Ctl {
    vm: String,
    w: UnixStream,
    r: BufReader<UnixStream>,
    partial: String,
}

impl Ctl {
    fn new(vm: &str, s: UnixStream) -> anyhow::Result<Ctl> {
        s.set_read_timeout(Some(Duration::from_millis(200)))?;
        Ok(Ctl {
            vm: vm.into(),
            r: BufReader::new(s.try_clone()?),
            w: s,
            partial: String::new(),
        })
    }

    /// Sends one command line.
    pub fn send(&mut self, line: &str) -> anyhow::Result<()> {
        self.w
            .write_all(format!("{line}\n").as_bytes())
            .with_context(|| format!("{}: writing to the agent", self.vm))
    }

    /// The next line from the agent within `timeout`.
    fn line(&mut self, timeout: Duration) -> anyhow::Result<String> {
        match self.try_line(timeout)? {
            Some(l) => Ok(l),
            None => bail!("{}: no answer from the agent within {timeout:?}", self.vm),
        }
    }

    /// The next line from the agent, or `None` if none came within `timeout`
    /// (a part of a line stays for the next call).
    fn try_line(&mut self, timeout: Duration) -> anyhow::Result<Option<String>> {
        let deadline = Instant::now() + timeout;
        loop {
            match self.r.read_line(&mut self.partial) {
                Ok(0) => bail!("{}: the agent's port closed", self.vm),
                Ok(_) if self.partial.ends_with('\n') => {
                    let l = std::mem::take(&mut self.partial);
                    return Ok(Some(l.trim_end().to_string()));
                }
                Ok(_) => {}
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) => {}
                Err(e) => return Err(e).with_context(|| format!("{}: reading the agent", self.vm)),
            }
            if self.partial.len() > 4096 {
                bail!("{}: the agent sent a line over 4 KiB", self.vm);
            }
            if Instant::now() > deadline {
                return Ok(None);
            }
        }
    }

    /// Waits for a line starting with `word` (`ready`, `done`, `hello`); an
    /// `error` line is the command's failure.
    pub fn expect(&mut self, word: &str, timeout: Duration) -> anyhow::Result<Kv> {
        let l = self.line(timeout)?;
        let mut w = l.split_whitespace();
        match w.next() {
            Some(x) if x == word => Ok(Kv::parse(w)),
            Some("error") => bail!("{}: {}", self.vm, l.trim_start_matches("error ")),
            _ => bail!("{}: expected `{word}`, the agent said `{l}`", self.vm),
        }
    }

    /// Sends a command and waits for its `ready`.
    pub fn start(&mut self, line: &str) -> anyhow::Result<()> {
        self.send(line)?;
        self.expect("ready", Duration::from_secs(60)).map(|_| ())
    }
}

fn connect_unix(path: &Path, deadline: Instant) -> anyhow::Result<UnixStream> {
    loop {
        match UnixStream::connect(path) {
            Ok(s) => return Ok(s),
            Err(e) if Instant::now() > deadline => {
                return Err(e).with_context(|| format!("connecting to {}", path.display()))
            }
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// One booted VM with its agent.
pub struct Vm {
    pub name: String,
    /// The guest's address on the bridge.
    pub addr: String,
    pub ctl: Ctl,
    /// The host end of the `virtio-serial` system's port.
    pub serial: UnixStream,
    child: Child,
    console: PathBuf,
    pub boot: Duration,
}

/// Starts VM number `index` (its tap must exist) and returns it once QEMU
/// runs; [`Vm::wait_agent`] waits for its agent.
pub fn launch(
    launcher: &Launcher,
    image: &Image,
    ns: &Netns,
    dir: &Path,
    index: usize,
    mem_mib: u32,
) -> anyhow::Result<(Child, VmPaths)> {
    let name = format!("bench-{}", (b'a' + index as u8) as char);
    let tap = format!("fbtap{index}");
    let addr = format!("10.77.0.{}", 11 + index);
    let p = VmPaths {
        name: name.clone(),
        addr: addr.clone(),
        ctl: dir.join(format!("{name}-ctl.sock")),
        serial: dir.join(format!("{name}-serial.sock")),
        console: dir.join(format!("{name}-console.log")),
        console_sock: dir.join(format!("{name}-console.sock")),
    };
    let cmdline_extra = format!(
        "fido.ip={addr}/24 fido.hostname={name} fido.run=\"/bin/fido-bench vm-endpoint --mode agent\""
    );
    // The devices of the baselines and of the agent, beside whatever the
    // launcher adds: one virtio-serial controller with the agent's port and
    // the virtio-serial system's port (host ends: Unix sockets, QEMU
    // listening), one virtio-net on the tap.
    let chardev = |id: &str, path: &Path| {
        format!("socket,id={id},path={},server=on,wait=off", path.display())
    };
    let devices: Vec<String> = vec![
        "-device".into(),
        "virtio-serial-pci,id=benchser".into(),
        "-chardev".into(),
        chardev("benchctl", &p.ctl),
        "-device".into(),
        format!("virtserialport,bus=benchser.0,chardev=benchctl,name={CTL_PORT}"),
        "-chardev".into(),
        chardev("benchdata", &p.serial),
        "-device".into(),
        format!("virtserialport,bus=benchser.0,chardev=benchdata,name={SERIAL_PORT}"),
        "-netdev".into(),
        format!("tap,id=benchnet,ifname={tap},script=no,downscript=no,vhost=off"),
        "-device".into(),
        format!(
            "virtio-net-pci,netdev=benchnet,mac=52:54:00:77:00:{:02x}",
            11 + index
        ),
    ];
    let log = File::create(dir.join(format!("{name}-qemu.log")))?;
    // QEMU opens its tap by name, so it runs in the namespace (`ip netns
    // exec` execs it: the child's pid is QEMU's, or `fido vm run`'s).
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", &ns.name]);
    match launcher {
        Launcher::Qemu => {
            cmd.arg("qemu-system-x86_64")
                .args(["-machine", "q35", "-accel"])
                .arg(if accel().0 == "kvm" {
                    "kvm"
                } else {
                    "tcg,thread=multi"
                })
                .args(["-cpu", guest_cpu(), "-smp", &guest_smp(), "-m", &format!("{mem_mib}M")])
                .args(["-nographic", "-nodefaults", "-no-user-config", "-no-reboot"])
                // As under `fido vm run`, whose guests need it for VFIO: the
                // baselines run on the same machine model.
                .args(["-device", "intel-iommu,intremap=on"])
                .arg("-chardev")
                .arg(chardev("benchcon", &p.console_sock))
                .args(["-serial", "chardev:benchcon"])
                .arg("-kernel")
                .arg(&image.kernel)
                .arg("-initrd")
                .arg(&image.initrd)
                .arg("-append")
                .arg(format!("{} {cmdline_extra}", image.cmdline))
                .args(&devices);
        }
        Launcher::FidoVm { fido, broker } => {
            // ---- Fido plugs in here -------------------------------------
            // The VM as a Fido domain: `fido vm run` (the VM's supervisor)
            // builds q35 + IOMMU + the VM's arena, doorbell device and
            // `org.fido.broker` port, and appends our devices (after `--`).
            cmd.arg(fido)
                .args(["vm", "run", &name, "--kernel"])
                .arg(&image.kernel)
                .arg("--initrd")
                .arg(&image.initrd)
                .args([
                    "--mem",
                    &mem_mib.to_string(),
                    "--cpus",
                    "1",
                    "--accel",
                    accel().0,
                ])
                .arg("--append")
                .arg(format!("{} {cmdline_extra}", image.cmdline))
                .arg("--console")
                .arg(&p.console_sock)
                .arg("--socket")
                .arg(broker)
                .arg("--")
                .args(&devices);
        }
    }
    cmd.stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log);
    let child = cmd
        .spawn()
        .with_context(|| format!("starting {name}: {cmd:?}"))?;
    // The serial console into a file from the first byte (for error
    // reports), on a thread of its own until QEMU closes it.
    let (sock, log_path) = (p.console_sock.clone(), p.console.clone());
    std::thread::spawn(move || {
        let Ok(mut con) = connect_unix(&sock, Instant::now() + Duration::from_secs(60)) else {
            return;
        };
        if let Ok(mut log) = File::create(&log_path) {
            let _ = std::io::copy(&mut con, &mut log);
        }
    });
    Ok((child, p))
}

/// Where a launched VM's sockets and logs are.
pub struct VmPaths {
    pub name: String,
    pub addr: String,
    ctl: PathBuf,
    serial: PathBuf,
    console: PathBuf,
    console_sock: PathBuf,
}

impl VmPaths {
    /// Connects to the VM's ports and waits for its agent's `hello`; fails
    /// early if the VM stops or we are interrupted.
    pub fn wait_agent(
        self,
        mut child: Child,
        started: Instant,
        timeout: Duration,
    ) -> anyhow::Result<Vm> {
        let deadline = started + timeout;
        let mut alive = || -> anyhow::Result<()> {
            if let Some(st) = child.try_wait()? {
                bail!("{} stopped while booting ({st})", self.name);
            }
            fido_demo::proc::check_interrupt()?;
            if Instant::now() > deadline {
                bail!("{}: no agent within {timeout:?}", self.name);
            }
            Ok(())
        };
        let r = (|| {
            let ctl = loop {
                alive()?;
                if let Ok(s) = UnixStream::connect(&self.ctl) {
                    break s;
                }
                std::thread::sleep(Duration::from_millis(50));
            };
            let mut ctl = Ctl::new(&self.name, ctl)?;
            let serial = loop {
                alive()?;
                if let Ok(s) = UnixStream::connect(&self.serial) {
                    break s;
                }
                std::thread::sleep(Duration::from_millis(50));
            };
            // A hung guest fails the case that reads, not the run.
            serial.set_read_timeout(Some(super::fidoops::STALL))?;
            loop {
                alive()?;
                if let Some(l) = ctl.try_line(Duration::from_secs(1))? {
                    if l.starts_with("hello") {
                        break;
                    }
                    bail!("{}: expected hello, the agent said `{l}`", self.name);
                }
            }
            Ok::<_, anyhow::Error>((ctl, serial))
        })();
        match r {
            Ok((ctl, serial)) => Ok(Vm {
                name: self.name,
                addr: self.addr,
                ctl,
                serial,
                child,
                console: self.console,
                boot: started.elapsed(),
            }),
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                std::thread::sleep(Duration::from_millis(200));
                let tail = console_tail(&self.console);
                Err(e.context(format!("{} did not come up; console:\n{tail}", self.name)))
            }
        }
    }
}

fn console_tail(p: &Path) -> String {
    let t = std::fs::read_to_string(p).unwrap_or_default();
    let lines: Vec<&str> = t.lines().collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}

impl Vm {
    /// The last lines of the guest's console (for error reports).
    pub fn console_tail(&self) -> String {
        console_tail(&self.console)
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        // Ask the agent to finish, then stop the VM: by pid, ours only.
        // SIGTERM first: `fido vm run` then stops its QEMU and tells the broker.
        let _ = self.ctl.send("quit");
        if let Some(pid) = rustix::process::Pid::from_raw(self.child.id() as i32) {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
        }
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(10) {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
