//! VM domains end to end, attacked and failed for real: `fido broker` and
//! `fido vm run` as child processes, the test guest of scripts/vm-image.sh
//! under TCG, host domains in this process. The VMs are booted once for the
//! whole binary (a shared fixture; tests take it in turn: two cores) and
//! killed at exit.
//!
//! 1. host↔VM both ways and VM↔VM: zero copy, same pointer, payload checked;
//!    `fido status` shows the VM's domains labelled with its name, its uid.
//! 2. a guest writing a peer's arena (as root, through /dev/mem and a
//!    read-write mapping of the BAR) changes nothing; fido maps it read-only.
//! 3. `kill -9` of QEMU: `PeerGone` for the host peer, whose delivered
//!    messages stay readable and whose other connection keeps working; the
//!    supervisor exits and the broker drops the VM's domains; then the
//!    micro-reboot: `fido vm run` and `fido vm stop`/`run` under the same
//!    name serve again.
//! 4. a broker killed and restarted under a VM↔host stream: it keeps
//!    streaming; while it streams the supervisor relays no frames.
//! 5. the policy applies to a VM launched by another user (its uid).
//! 6. a host peer that makes its doorbell blocking and never reads cannot
//!    freeze the VM.

use fido::{Domain, JoinOptions, Message};
use fido_test_support::vm::{self, Console, Image, BOOT_TIMEOUT};
use serde_json::Value;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

/// A guest command's limit: TCG on a loaded 2-core machine is slow.
const CMD: Duration = Duration::from_secs(120);
/// How long a failure may take to be noticed (PeerGone, a supervisor's exit).
const NOTICE: Duration = Duration::from_secs(30);

/// The pids this binary started (brokers, supervisors), killed at exit:
/// statics are never dropped.
static CHILDREN: Mutex<Vec<u32>> = Mutex::new(Vec::new());
/// The fixture's directory, removed at exit after its processes.
static FIXTURE_DIR: Mutex<Option<PathBuf>> = Mutex::new(None);

extern "C" fn kill_children() {
    let pids = CHILDREN.lock().map(|v| v.clone()).unwrap_or_default();
    for pid in pids {
        if let Some(p) = rustix::process::Pid::from_raw(pid as i32) {
            // A supervisor killed by SIGKILL leaves QEMU to its parent-death
            // signal; SIGTERM lets it stop QEMU itself, SIGKILL follows.
            let _ = rustix::process::kill_process(p, rustix::process::Signal::TERM);
        }
    }
    std::thread::sleep(Duration::from_millis(500));
    let pids = CHILDREN.lock().map(|v| v.clone()).unwrap_or_default();
    for pid in pids {
        if let Some(p) = rustix::process::Pid::from_raw(pid as i32) {
            let _ = rustix::process::kill_process(p, rustix::process::Signal::KILL);
        }
    }
    std::thread::sleep(Duration::from_millis(200));
    if let Some(dir) = FIXTURE_DIR.lock().ok().and_then(|d| d.clone()) {
        let _ = std::fs::remove_dir_all(dir);
    }
}

fn track(child: &Child) {
    static AT_EXIT: OnceLock<()> = OnceLock::new();
    AT_EXIT.get_or_init(|| {
        // SAFETY: registers a plain `extern "C" fn` with no arguments, which
        // only signals pids and touches a static mutex.
        unsafe { libc::atexit(kill_children) };
    });
    CHILDREN.lock().unwrap_or_else(|e| e.into_inner()).push(child.id());
}

/// The workspace's `fido` (the one in the guest image too).
fn fido_bin() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().parent().unwrap().join("fido")
}

/// A `fido vm run` whose guest is booting.
struct Starting {
    name: String,
    supervisor: Child,
    log: PathBuf,
    console: PathBuf,
}

/// A VM started with `fido vm run`, its console attached.
struct Vm {
    name: String,
    supervisor: Child,
    console: Console,
    log: PathBuf,
}

impl Vm {
    fn supervisor_log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

struct Fixture {
    dir: tempfile::TempDir,
    image: Image,
    socket: PathBuf,
    policy: PathBuf,
    broker: Child,
    /// The VMs by name: "a" and "b" (each test leaves them serving).
    vms: Vec<Vm>,
}

/// The fixture, booted by the first test that asks (`None`: QEMU missing).
fn fixture() -> Option<MutexGuard<'static, Fixture>> {
    static FIXTURE: OnceLock<Option<Mutex<Fixture>>> = OnceLock::new();
    let f = FIXTURE.get_or_init(|| {
        if !vm::qemu_available() {
            return None;
        }
        Some(Mutex::new(Fixture::start()))
    });
    match f {
        None => {
            eprintln!("SKIPPED: qemu-system-x86_64 is not installed");
            None
        }
        // A test that panicked leaves the VMs to the next one, without the
        // guest programs it started (one Fido guest per VM at a time).
        Some(m) => {
            let mut f = m.lock().unwrap_or_else(|e| e.into_inner());
            for vm in &mut f.vms {
                vm.console.run_ok("killall -9 fido 2>/dev/null; true", CMD);
            }
            Some(f)
        }
    }
}

const ROOT_ONLY: &str = "[[rule]]\nname = \"root\"\nuids = [0]\noffer = [\"*\"]\nconnect = [\"*\"]\n";

impl Fixture {
    fn start() -> Fixture {
        let t = Instant::now();
        let image = vm::image();
        let dir = tempfile::Builder::new().prefix("fido-vmtests-").tempdir().unwrap();
        // Another user's supervisor reaches the broker's socket through it.
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        *FIXTURE_DIR.lock().unwrap_or_else(|e| e.into_inner()) = Some(dir.path().to_path_buf());
        let xdg = dir.path().join("xdg");
        std::fs::create_dir(&xdg).unwrap();
        std::fs::set_permissions(&xdg, std::fs::Permissions::from_mode(0o700)).unwrap();
        let policy = dir.path().join("policy.toml");
        std::fs::write(&policy, ROOT_ONLY).unwrap();
        let socket = dir.path().join("broker.sock");
        let mut f = Fixture { broker: start_broker(dir.path(), &socket, &policy), dir, image, socket, policy, vms: Vec::new() };
        let starting: Vec<_> = ["a", "b"].iter().map(|n| f.spawn_vm(n, None)).collect();
        for s in starting {
            let vm = f.attach(s);
            f.vms.push(vm);
        }
        eprintln!("fixture: broker and VMs a, b ready in {:.1?}", t.elapsed());
        f
    }

    /// `fido` with this fixture's VM records and broker.
    fn fido(&self) -> Command {
        let mut c = Command::new(fido_bin());
        c.env("XDG_RUNTIME_DIR", self.dir.path().join("xdg")).env("FIDO_BROKER", &self.socket);
        c
    }

    /// Starts `fido vm run NAME` (as `user` when given, with its own record
    /// directory), console on a socket in the fixture's directory.
    fn spawn_vm(&self, name: &str, user: Option<(fido_test_support::users::User, &Path, &Path)>) -> Starting {
        let console = match user {
            Some((_, _, consoles)) => consoles.join(format!("{name}.console")),
            None => self.dir.path().join(format!("{name}.console")),
        };
        let _ = std::fs::remove_file(&console);
        let log = self.dir.path().join(format!("{name}.supervisor.log"));
        let args: Vec<String> = [
            "vm", "run", name, "--kernel", &self.image.kernel.display().to_string(), "--initrd",
            &self.image.initrd.display().to_string(), "--append", &self.image.cmdline, "--console",
            &console.display().to_string(), "--socket", &self.socket.display().to_string(), "--mem", "256",
            "--arena", "16M", "--max-peer-arena", "64M",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let mut cmd = fido_test_support::child::as_user(user.map(|u| u.0), &fido_bin(), &args);
        cmd.env("XDG_RUNTIME_DIR", match user {
            Some((_, xdg, _)) => xdg.to_path_buf(),
            None => self.dir.path().join("xdg"),
        });
        let out = std::fs::File::create(&log).unwrap();
        cmd.stdin(Stdio::null()).stdout(out.try_clone().unwrap()).stderr(out);
        let child = cmd.spawn().unwrap_or_else(|e| panic!("starting fido vm run {name}: {e}"));
        track(&child);
        Starting { name: name.to_string(), supervisor: child, log, console }
    }

    /// Waits for the VM's shell.
    fn attach(&self, starting: Starting) -> Vm {
        let Starting { name, mut supervisor, log, console: path } = starting;
        let t = Instant::now();
        let deadline = Instant::now() + Duration::from_secs(60);
        while !path.exists() {
            if let Some(st) = supervisor.try_wait().unwrap() {
                panic!("fido vm run {name} exited ({st}):\n{}", std::fs::read_to_string(&log).unwrap_or_default());
            }
            assert!(Instant::now() < deadline, "no console for {name}:\n{}", std::fs::read_to_string(&log).unwrap_or_default());
            std::thread::sleep(Duration::from_millis(20));
        }
        let mut console = Console::connect(&path, Duration::from_secs(30)).unwrap();
        if let Err(e) = console.wait_for_shell(BOOT_TIMEOUT) {
            panic!("{name}: {e}\n{}\n{}", console.transcript(), std::fs::read_to_string(&log).unwrap_or_default());
        }
        eprintln!("VM {name}: shell after {:.1?}", t.elapsed());
        Vm { name, supervisor, console, log }
    }

    fn vm(&mut self, name: &str) -> &mut Vm {
        self.vms.iter_mut().find(|v| v.name == name).unwrap()
    }

    fn console(&mut self, name: &str) -> &mut Console {
        &mut self.vm(name).console
    }

    /// A host domain of this process.
    fn join(&self, name: &str) -> Domain {
        Domain::join(JoinOptions::new(name).broker(&self.socket).arena_len(16 << 20)).unwrap()
    }

    /// `fido status --json`.
    fn status(&self) -> Value {
        let out = fido_test_support::wait::run_ok(
            {
                let mut c = self.fido();
                c.args(["status", "--json"]);
                c
            },
            Duration::from_secs(30),
        );
        serde_json::from_str(&out).unwrap()
    }

    /// This fixture's VM records (`fido vm list --json`).
    fn vm_record(&self, name: &str) -> Option<Value> {
        let mut c = self.fido();
        c.args(["vm", "list", "--json"]);
        let out = fido_test_support::wait::run_ok(c, Duration::from_secs(30));
        out.lines().map(|l| serde_json::from_str::<Value>(l).unwrap()).find(|r| r["name"] == name)
    }

    /// Domains of the broker labelled `label`.
    fn labelled(&self, label: &str) -> Vec<Value> {
        self.status()["domains"].as_array().unwrap().iter().filter(|d| d["label"] == label).cloned().collect()
    }

    fn restart_broker(&mut self) {
        let _ = self.broker.kill();
        let _ = self.broker.wait();
        self.broker = start_broker(self.dir.path(), &self.socket, &self.policy);
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        for vm in &mut self.vms {
            let _ = vm.supervisor.kill();
            let _ = vm.supervisor.wait();
        }
        let _ = self.broker.kill();
        let _ = self.broker.wait();
    }
}

fn start_broker(dir: &Path, socket: &Path, policy: &Path) -> Child {
    let _ = std::fs::remove_file(socket);
    let log = std::fs::OpenOptions::new().create(true).append(true).open(dir.join("broker.log")).unwrap();
    let child = Command::new(fido_bin())
        .args(["broker", "--socket"])
        .arg(socket)
        .arg("--state-dir")
        .arg(dir.join("state"))
        .arg("--policy")
        .arg(policy)
        .args(["--pipe-capacity", "unlimited"])
        // TCG guests on a loaded two-core machine can miss a few 500 ms
        // heartbeats; the deaths tested here are seen by their sockets.
        .args(["--heartbeat-misses", "20"])
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .unwrap();
    track(&child);
    fido_test_support::wait::eventually("the broker's socket", Duration::from_secs(30), || socket.exists());
    child
}

/// The JSON line starting with `{"key"` in `out`.
fn json_line(out: &str, key: &str) -> Value {
    let prefix = format!("{{\"{key}\"");
    let line = out
        .lines()
        .find(|l| l.starts_with(&prefix) || (l.starts_with('{') && serde_json::from_str::<Value>(l).is_ok_and(|v| v.get(key).is_some())))
        .unwrap_or_else(|| panic!("no JSON line with {key:?} in:\n{out}"));
    serde_json::from_str(line).unwrap()
}

/// Waits until the guest file `log` has a JSON line with `key`.
fn wait_log(c: &mut Console, log: &str, key: &str, timeout: Duration) -> Value {
    let deadline = Instant::now() + timeout;
    loop {
        let out = c.run_ok(&format!("cat {log}"), CMD);
        if let Some(v) = out.lines().filter(|l| l.starts_with('{')).filter_map(|l| serde_json::from_str::<Value>(l).ok()).find(|v| v.get(key).is_some()) {
            return v;
        }
        assert!(Instant::now() < deadline, "no {key:?} in the guest's {log}:\n{out}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Serves `service` from `d`: each connection's messages go back forwarded
/// (counted in `count`) until it ends. Returns once the service is offered.
fn host_echo(d: &Domain, service: &str, count: Arc<AtomicU64>) -> std::thread::JoinHandle<()> {
    let listener = d.offer(service).unwrap();
    std::thread::spawn(move || {
        while let Ok(ch) = listener.accept() {
            let count = count.clone();
            std::thread::spawn(move || {
                while let Ok(m) = ch.recv() {
                    if ch.forward(m).is_err() {
                        return;
                    }
                    count.fetch_add(1, Ordering::Relaxed);
                }
            });
        }
    })
}

/// `n` round trips of `size` bytes from a host domain: each reply must be
/// the buffer sent (same global pointer, same bytes).
fn host_ping(d: &Domain, ch: &fido::Channel, n: u64, size: usize) {
    for i in 0..n {
        let mut buf = d.alloc(size).unwrap();
        let fill = (i as u8).wrapping_mul(13).wrapping_add(1);
        buf.fill(fill);
        let sent = buf.gptr();
        ch.send(Message::new(buf)).map_err(|e| e.error).unwrap();
        let reply = ch.recv_timeout(CMD).unwrap_or_else(|e| panic!("round trip {i}: {e}"));
        assert_eq!(reply.global_segments().next().map(|(g, _)| g), Some(sent), "round trip {i}: not the buffer sent");
        let bytes = reply.as_slice().unwrap();
        assert_eq!(bytes.len(), size);
        assert!(bytes.iter().all(|b| b == fill), "round trip {i}: payload changed");
    }
}

fn connect_retry(d: &Domain, service: &str) -> fido::Channel {
    fido_test_support_connect(d, service, Duration::from_secs(60))
}

fn fido_test_support_connect(d: &Domain, service: &str, timeout: Duration) -> fido::Channel {
    let deadline = Instant::now() + timeout;
    loop {
        match d.connect(service) {
            Ok(c) => return c,
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
            Err(e) => panic!("connect {service}: {e}"),
        }
    }
}

fn assert_zero_copy_ping(v: &Value, count: u64) {
    assert_eq!(v["count"], count, "{v}");
    assert_eq!(v["same_pointer"], true, "{v}");
    assert_eq!(v["checksum_ok"], true, "{v}");
    assert_eq!(v["bytes_copied"], 0, "{v}");
}

#[test]
fn round_trips_host_to_vm_vm_to_host_and_vm_to_vm_are_zero_copy() {
    let Some(mut f) = fixture() else { return };
    let t = Instant::now();
    let host = f.join("host-1");
    let echoed = Arc::new(AtomicU64::new(0));
    let _server = host_echo(&host, "host-echo-1", echoed.clone());

    // A guest program killed (-9) while streaming: the next program of the
    // VM starts afresh (its Join is not "already joined", its vectors are
    // not "in use" by the dead program's connections).
    let killed = f.console("a").spawn("fido guest ping host-echo-1 --count 1000000000 --size 64").unwrap();
    fido_test_support::wait::eventually("the stream", CMD, || echoed.load(Ordering::Relaxed) > 100);
    f.console("a").run_ok(&format!("kill -9 {}; sleep 0.5", killed.pid), CMD);
    let before = echoed.load(Ordering::Relaxed);

    // VM → host: the guest pings the host's echo.
    let out = f.console("a").run_ok("fido guest ping host-echo-1 --count 200 --size 4096", CMD);
    assert_zero_copy_ping(&json_line(&out, "service"), 200);
    fido_test_support::wait::eventually("200 messages echoed", NOTICE, || echoed.load(Ordering::Relaxed) == before + 200);

    // Host → VM: the guest serves, the host pings; the guest's domain shows
    // in `fido status` labelled with the VM's name, with the launching uid.
    let echo = f.console("a").spawn("fido guest echo a-echo-1 --count 1").unwrap();
    wait_log(f.console("a"), &echo.log, "ready", CMD);
    let sup_pid = f.vm("a").supervisor.id();
    let doms = f.labelled("a");
    let d = doms.iter().find(|d| d["name"] == "fido-echo").unwrap_or_else(|| panic!("no domain labelled a: {}", f.status()));
    assert_eq!(d["uid"], 0, "{d}");
    assert_eq!(d["pid"], sup_pid, "the broker sees the supervisor: {d}");
    assert!(f.labelled("b").iter().all(|d| d["name"] != "fido-echo"), "the label is the VM's own");
    let ch = connect_retry(&host, "a-echo-1");
    host_ping(&host, &ch, 200, 4096);
    drop(ch);
    assert_eq!(host.counters().bytes_copied, 0);
    wait_log(f.console("a"), &echo.log, "done", CMD);

    // VM → VM: b pings a's echo.
    let echo = f.console("a").spawn("fido guest echo a-echo-2 --count 1").unwrap();
    wait_log(f.console("a"), &echo.log, "ready", CMD);
    let out = f.console("b").run_ok("fido guest ping a-echo-2 --count 200 --size 4096", CMD);
    assert_zero_copy_ping(&json_line(&out, "service"), 200);
    let done = wait_log(f.console("a"), &echo.log, "done", CMD);
    assert_eq!(done["bytes_copied"], 0, "{done}");
    eprintln!("round trips: {:.1?}", t.elapsed());
}

/// Under TCG the guest's CPU has no fast-string features: with them glibc and
/// the guest kernel move memory with `rep movsb`/`rep stosb`, which TCG runs
/// a byte at a time, about ten times slower (`fido_vm::qemu::TCG_CPU`).
#[test]
fn a_tcg_guest_moves_memory_without_fast_strings() {
    let Some(mut f) = fixture() else { return };
    if fido_vm::qemu::choose_accel(None).0 != fido_vm::qemu::Accel::Tcg {
        eprintln!("SKIPPED: the VMs run under KVM (-cpu host)");
        return;
    }
    let out = f.console("a").run_ok("grep -o -w -e erms -e fsrm /proc/cpuinfo | wc -l", CMD);
    assert_eq!(out.trim(), "0", "the guest's CPU offers erms/fsrm");
    // The line the grep reads is there (a flag this model does have).
    let out = f.console("a").run_ok("grep -c -w sse2 /proc/cpuinfo", CMD);
    assert_eq!(out.trim(), "1", "one vCPU with sse2: {out}");
}

#[test]
fn a_guest_writing_a_peer_arena_changes_nothing() {
    let Some(mut f) = fixture() else { return };
    let t = Instant::now();
    let host = f.join("host-2");
    let listener = host.offer("host-hold").unwrap();
    let release = "/tmp/release-hold";
    let held = f.console("a").spawn(&format!("rm -f {release}; fido guest __hold host-hold --release {release}")).unwrap();
    let ch = listener.accept_timeout(CMD).unwrap();
    let mut buf = host.alloc(64 << 10).unwrap();
    buf.fill(0x5a);
    let sent = buf.gptr();
    ch.send(Message::new(buf)).map_err(|e| e.error).unwrap();
    let c = f.console("a");
    let seen = wait_log(c, &held.log, "holding", CMD);
    assert_eq!(seen["gptr"], sent.0, "the guest sees the host's global pointer: {seen}");
    assert_eq!(seen["addr"], sent.0, "at the same address: {seen}");
    assert!(seen["uniform"] == true && seen["first"] == 0x5a, "{seen}");
    // fido mapped the peer's BAR read-only, and it stays so.
    let map = seen["map"].as_str().unwrap();
    let fields: Vec<&str> = map.split_whitespace().collect();
    assert_eq!(fields[1], "r--s", "the peer arena is mapped read-only: {map}");
    let resource2 = fields.last().unwrap().to_string();
    assert!(resource2.ends_with("/resource2"), "{map}");
    assert!(!seen["forced_write"].as_str().unwrap().starts_with("wrote"), "a forced write through fido's mapping went through: {seen}");
    let dev = resource2.trim_end_matches("/resource2").to_string();
    let offset = seen["file_offset"].as_u64().unwrap();

    // Root in the guest writes the BAR through /dev/mem...
    let res = c.run_ok(&format!("sed -n 3p {dev}/resource"), CMD);
    let bar2 = u64::from_str_radix(res.split_whitespace().next().unwrap().trim_start_matches("0x"), 16).unwrap();
    let word = bar2 + offset;
    // (Reads through /dev/mem may show zeros where the kernel restricts it:
    // the host's buffer below is what counts.)
    let driver = c.run_ok(&format!("readlink {dev}/driver; true"), CMD);
    let before = c.run_ok(&format!("devmem {word:#x} 32"), CMD);
    c.run_ok(&format!("devmem {word:#x} 32 0xdeadbeef; devmem {:#x} 32 0xdeadbeef", word + 64), CMD);
    let after = c.run_ok(&format!("devmem {word:#x} 32"), CMD);
    eprintln!("/dev/mem at {word:#x} (driver {:?}): {} before the write, {} after", driver.trim(), before.trim(), after.trim());
    assert_eq!(before.trim(), after.trim(), "a /dev/mem write changed the peer arena");
    // ... and through a read-write mapping of resource2, which root may make.
    let poke = json_line(&c.run_ok(&format!("fido guest __poke {resource2} {} 3735928559", offset + 128), CMD), "path");
    eprintln!("read-write mapping of the peer's BAR: {poke}");
    if poke.get("failed").is_none() {
        assert_eq!(poke["before"], 0x5a5a_5a5a_u64, "{poke}");
        assert_eq!(poke["read_back"], 0x5a5a_5a5a_u64, "a write through a mapping reached the peer arena: {poke}");
    }

    // The host's own buffer, back from the guest: the same bytes.
    c.run_ok(&format!("touch {release}"), CMD);
    let reply = ch.recv_timeout(CMD).unwrap();
    assert_eq!(reply.global_segments().next().map(|(g, _)| g), Some(sent));
    let bytes = reply.as_slice().unwrap();
    assert_eq!(bytes.len(), 64 << 10);
    let bad: Vec<usize> = bytes.iter().enumerate().filter(|(_, b)| *b != 0x5a).map(|(i, _)| i).take(8).collect();
    assert!(bad.is_empty(), "the host's arena changed at {bad:?}");
    drop(reply);
    drop(ch);
    wait_log(c, &held.log, "released", CMD);
    eprintln!("isolation: {:.1?}", t.elapsed());
}

/// What a held message of `fido guest ping` carries: message `i` is filled
/// with `i * 31 + 7`.
fn ping_fill(i: u64) -> u8 {
    (i as u8).wrapping_mul(31).wrapping_add(7)
}

#[test]
fn kill_9_of_qemu_is_peer_gone_and_the_vm_restarts_under_its_name() {
    let Some(mut f) = fixture() else { return };
    let t = Instant::now();
    let host = f.join("host-3");
    // Connection 1: b streams into the host, which keeps its first messages.
    let listener = host.offer("host-sink").unwrap();
    let ping = f.console("b").spawn("fido guest ping host-sink --count 1000000000 --size 256").unwrap();
    let ch = listener.accept_timeout(CMD).unwrap();
    let mut held = Vec::new();
    for i in 0..20 {
        let m = ch.recv_timeout(CMD).unwrap_or_else(|e| {
            let log = f.console("b").run_ok(&format!("cat {}; ls /sys/bus/pci/devices/", ping.log), CMD);
            panic!("message {i}: {e}\nthe guest's ping:\n{log}\n{}", f.vm("b").supervisor_log())
        });
        assert!(m.as_slice().unwrap().iter().all(|b| b == ping_fill(i)));
        held.push(m);
        let mut reply = host.alloc(256).unwrap();
        reply.fill(0);
        ch.send(Message::new(reply)).map_err(|e| e.error).unwrap();
    }
    let stop = Arc::new(AtomicBool::new(false));
    let (ch, stop2) = (Arc::new(ch), stop.clone());
    let ch2 = ch.clone();
    let streamer = std::thread::spawn(move || -> (u64, Result<(), fido::Error>) {
        let mut n = 0;
        loop {
            match ch2.recv_timeout(Duration::from_millis(200)) {
                Ok(m) => {
                    n += 1;
                    // A failed forward: the next recv says why.
                    let _ = ch2.forward(m);
                }
                Err(fido::Error::Timeout) if !stop2.load(Ordering::Relaxed) => {}
                Err(e) => return (n, Err(e)),
            }
        }
    });
    // Connection 2: with a's echo.
    let echo = f.console("a").spawn("fido guest echo a-echo-3 --count 1").unwrap();
    wait_log(f.console("a"), &echo.log, "ready", CMD);
    let other = connect_retry(&host, "a-echo-3");
    host_ping(&host, &other, 10, 512);

    let qemu = f.vm_record("b").expect("b's record")["qemu_pid"].as_i64().unwrap();
    let killed = Instant::now();
    rustix::process::kill_process(rustix::process::Pid::from_raw(qemu as i32).unwrap(), rustix::process::Signal::KILL).unwrap();
    let deadline = Instant::now() + NOTICE;
    while !streamer.is_finished() {
        assert!(Instant::now() < deadline, "no PeerGone {NOTICE:?} after kill -9 of QEMU");
        std::thread::sleep(Duration::from_millis(20));
    }
    stop.store(true, Ordering::Relaxed);
    let (streamed, end) = streamer.join().unwrap();
    eprintln!("kill -9 of QEMU: {end:?} after {:.2?} ({streamed} messages streamed before)", killed.elapsed());
    assert!(matches!(end, Err(fido::Error::PeerGone { .. })), "{end:?}");
    assert!(matches!(ch.recv_timeout(Duration::from_millis(100)), Err(fido::Error::PeerGone { .. })));
    // What was delivered stays readable, unchanged.
    for (i, m) in held.iter().enumerate() {
        assert!(m.as_slice().unwrap().iter().all(|b| b == ping_fill(i as u64)), "held message {i} changed");
    }
    drop(held);
    // The other connection keeps working.
    host_ping(&host, &other, 10, 512);
    drop(other);
    // The supervisor exits, and the broker drops b's domains.
    let deadline = Instant::now() + NOTICE;
    let st = loop {
        if let Some(st) = f.vm("b").supervisor.try_wait().unwrap() {
            break st;
        }
        assert!(Instant::now() < deadline, "the supervisor outlived QEMU:\n{}", f.vm("b").supervisor_log());
        std::thread::sleep(Duration::from_millis(20));
    };
    eprintln!("supervisor of b: {st}");
    fido_test_support::wait::eventually("the broker dropping b's domains", NOTICE, || f.labelled("b").is_empty());
    assert!(f.vm_record("b").is_none(), "b's record outlived it");
    f.vms.retain(|v| v.name != "b");
    drop(ch);

    // Micro-reboot: the same name again, twice (after the kill, after a stop).
    for round in 0..2 {
        let s = f.spawn_vm("b", None);
        let vm = f.attach(s);
        f.vms.push(vm);
        let echo = f.console("b").spawn(&format!("fido guest echo b-svc --count 1 --name b-echo-{round}")).unwrap();
        wait_log(f.console("b"), &echo.log, "ready", CMD);
        let ch = connect_retry(&host, "b-svc");
        host_ping(&host, &ch, 20, 1024);
        drop(ch);
        wait_log(f.console("b"), &echo.log, "done", CMD);
        fido_test_support::wait::eventually("b's echo leaving", NOTICE, || f.labelled("b").is_empty());
        if round == 0 {
            let mut c = f.fido();
            c.args(["vm", "stop", "b"]);
            fido_test_support::wait::run_ok(c, NOTICE);
            let st = f.vm("b").supervisor.wait().unwrap();
            assert!(st.success(), "fido vm stop: the supervisor ended {st}");
            f.vms.retain(|v| v.name != "b");
        }
    }
    eprintln!("kill -9 and micro-reboots: {:.1?}", t.elapsed());
}

fn relay_stats(f: &Fixture, vm: &str) -> Value {
    f.vm_record(vm).unwrap_or_else(|| panic!("no record of {vm}"))["relay"].clone()
}

#[test]
fn a_broker_restart_leaves_a_vm_stream_streaming_and_the_relay_idle() {
    let Some(mut f) = fixture() else { return };
    let t = Instant::now();
    let host = f.join("host-5");
    let count = Arc::new(AtomicU64::new(0));
    let _server = host_echo(&host, "host-stream", count.clone());
    let ping = f.console("a").spawn("fido guest ping host-stream --count 1000000000 --size 64").unwrap();
    fido_test_support::wait::eventually("the stream", CMD, || count.load(Ordering::Relaxed) > 500);

    // While it streams, the supervisor relays nothing but heartbeats and
    // counter publications (its record is updated once a second).
    std::thread::sleep(Duration::from_millis(1500));
    let (r0, n0) = (relay_stats(&f, "a"), count.load(Ordering::Relaxed));
    std::thread::sleep(Duration::from_secs(4));
    let (r1, n1) = (relay_stats(&f, "a"), count.load(Ordering::Relaxed));
    eprintln!("relay while streaming {} messages: {r0} -> {r1}", n1 - n0);
    assert!(n1 - n0 > 500, "the stream stalled: {n0} -> {n1}");
    let frames = |r: &Value| r["guest_frames"].as_u64().unwrap() - r["counters"].as_u64().unwrap();
    assert_eq!(frames(&r1), frames(&r0), "the guest sent control frames while streaming: {r0} -> {r1}");
    let answered = r1["broker_frames"].as_u64().unwrap() - r0["broker_frames"].as_u64().unwrap();
    let asked = (r1["heartbeats"].as_u64().unwrap() - r0["heartbeats"].as_u64().unwrap()) + (r1["counters"].as_u64().unwrap() - r0["counters"].as_u64().unwrap());
    assert!(answered <= asked, "the broker sent {answered} frames for {asked} heartbeats and publications: {r0} -> {r1}");
    assert_eq!(r1["plugs"], r0["plugs"]);

    // Kill the broker (SIGKILL) and start it again.
    let before = count.load(Ordering::Relaxed);
    f.restart_broker();
    let restarted = count.load(Ordering::Relaxed);
    std::thread::sleep(Duration::from_secs(5));
    let after = count.load(Ordering::Relaxed);
    eprintln!("broker restart: {before} before, {restarted} at the restart, {after} 5 s later");
    assert!(after > restarted + 200, "the stream stopped with the broker: {restarted} -> {after}");
    // Both ends are known to the new broker again: the guest's by its label.
    fido_test_support::wait::eventually("the guest's session resumed", NOTICE, || f.labelled("a").iter().any(|d| d["name"] == "fido-ping"));
    let later = count.load(Ordering::Relaxed);
    std::thread::sleep(Duration::from_secs(2));
    assert!(count.load(Ordering::Relaxed) > later + 100, "the stream stopped after the resume");
    f.console("a").run_ok(&format!("kill {}", ping.pid), CMD);
    eprintln!("broker restart: {:.1?}", t.elapsed());
}

#[test]
fn a_blocking_host_peer_cannot_freeze_a_vm() {
    let Some(mut f) = fixture() else { return };
    let t = Instant::now();
    // A VM of its own: the attack's aftermath stays out of the other tests.
    let s = f.spawn_vm("g", None);
    let vm = f.attach(s);
    f.vms.push(vm);
    let host = f.join("host-7");
    let listener = host.offer("host-guard").unwrap();
    let flood = f.console("g").spawn("fido guest __flood host-guard --echo g-echo-7").unwrap();
    let ch = Arc::new(listener.accept_timeout(CMD).unwrap());
    // The attack: our doorbell's ring end (QEMU writes the guest's rings
    // into its copy, the same open file) made blocking with a tiny buffer,
    // the receiver announced asleep again and again, and never read.
    let ring_end = ch.__own_data_bell().unwrap();
    rustix::net::sockopt::set_socket_send_buffer_size(&ring_end, 4096).unwrap();
    rustix::io::ioctl_fionbio(&ring_end, false).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let armer = {
        let (ch, stop) = (ch.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                ch.__arm_without_reading();
                // Take messages off the ring (never touching the doorbell)
                // so the guest keeps sending, hence ringing.
                while let Ok(Some(m)) = ch.try_recv_if_idle() {
                    drop(m);
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        })
    };
    // Meanwhile the VM answers its console and serves another connection.
    let other = f.join("host-7b");
    let c = f.console("g");
    for i in 0..5 {
        let t = Instant::now();
        let out = c.run(&format!("echo alive-{i}"), Duration::from_secs(30)).unwrap_or_else(|e| panic!("the VM froze: {e}"));
        assert_eq!(out.1.trim(), format!("alive-{i}"));
        eprintln!("console answered in {:.2?}", t.elapsed());
        std::thread::sleep(Duration::from_millis(500));
    }
    wait_log(c, &flood.log, "ready", CMD);
    let conn = connect_retry(&other, "g-echo-7");
    let t2 = Instant::now();
    host_ping(&other, &conn, 20, 256);
    eprintln!("another connection: 20 round trips in {:.2?}", t2.elapsed());
    // The attack was real: the rings reached our blocked doorbell.
    let mut queued = 0i32;
    // SAFETY: FIONREAD writes one int into `queued`.
    let r = unsafe { libc::ioctl(std::os::fd::AsRawFd::as_raw_fd(&ch.data_doorbell()), libc::FIONREAD, &mut queued) };
    assert_eq!(r, 0);
    eprintln!("bytes the guest's rings left in our blocked doorbell: {queued}");
    assert!(queued > 0, "the guest never rang us: the test proves nothing");
    // The guard cut the doorbell the attacker made blocking (shut down: the
    // same socket our ring end is).
    let cut = rustix::net::send(&ring_end, &[0u8; 8], rustix::net::SendFlags::DONTWAIT | rustix::net::SendFlags::NOSIGNAL);
    eprintln!("sending on our ring end after the attack: {cut:?}");
    assert!(matches!(cut, Err(rustix::io::Errno::PIPE)), "the guard never cut the blocking doorbell: {cut:?}");
    stop.store(true, Ordering::Relaxed);
    armer.join().unwrap();
    // The guest learnt that its peer is gone, and its other connection lived.
    let ended = wait_log(c, &flood.log, "flood_ended", CMD);
    eprintln!("the flooding guest program: {ended}");
    drop(conn);
    c.run_ok(&format!("kill {} 2>/dev/null; true", flood.pid), CMD);
    let log = f.vm("g").supervisor_log();
    eprintln!("guard: {:.1?}\n{log}", t.elapsed());
    assert!(log.contains("made its doorbell blocking"), "the supervisor did not report the cut:\n{log}");
    let mut vm = f.vms.pop().unwrap();
    assert_eq!(vm.name, "g");
    let _ = rustix::process::kill_process(rustix::process::Pid::from_raw(vm.supervisor.id() as i32).unwrap(), rustix::process::Signal::TERM);
    let _ = vm.supervisor.wait();
}

#[test]
fn the_policy_applies_to_a_vm_domain_by_its_launching_uid() {
    let Some(mut f) = fixture() else { return };
    let Some(user) = fido_test_support::users::test_user("fido-vmtest") else { return };
    let t = Instant::now();
    let xdg = f.dir.path().join("xdg-user");
    std::fs::create_dir_all(&xdg).unwrap();
    std::fs::set_permissions(&xdg, std::fs::Permissions::from_mode(0o700)).unwrap();
    rustix::fs::chown(&xdg, Some(rustix::fs::Uid::from_raw(user.uid)), Some(rustix::fs::Gid::from_raw(user.gid))).unwrap();
    // The user's console socket goes in a directory it may write.
    let cdir = f.dir.path().join("user-consoles");
    std::fs::create_dir_all(&cdir).unwrap();
    rustix::fs::chown(&cdir, Some(rustix::fs::Uid::from_raw(user.uid)), Some(rustix::fs::Gid::from_raw(user.gid))).unwrap();
    std::fs::write(&f.policy, ROOT_ONLY).unwrap();
    f.broker_reload();
    let s = f.spawn_vm("u", Some((user, &xdg, &cdir)));
    let vm = f.attach(s);
    f.vms.push(vm);
    // Root-only policy: the guest's join is refused, saying so.
    let (code, out) = f.console("u").run("fido guest check --name u-check", CMD).unwrap();
    eprintln!("guest join under a root-only policy: exit {code}: {out}");
    assert_ne!(code, 0, "{out}");
    assert!(out.contains(&format!("uid {}", user.uid)) && out.contains("may not join"), "{out}");
    // A policy admitting the user's uid: it joins, recorded with that uid.
    std::fs::write(&f.policy, format!("{ROOT_ONLY}[[rule]]\nname = \"vm-user\"\nuids = [{}]\nlabels = [\"u\"]\noffer = [\"u-*\"]\nconnect = [\"*\"]\n", user.uid)).unwrap();
    f.broker_reload();
    let echo = f.console("u").spawn("fido guest echo u-echo --count 1").unwrap();
    wait_log(f.console("u"), &echo.log, "ready", CMD);
    let doms = f.labelled("u");
    assert_eq!(doms.len(), 1, "{doms:?}");
    assert_eq!(doms[0]["uid"], user.uid, "{doms:?}");
    let host = f.join("host-6");
    let ch = connect_retry(&host, "u-echo");
    host_ping(&host, &ch, 10, 256);
    drop(ch);
    let mut vm = f.vms.pop().unwrap();
    assert_eq!(vm.name, "u");
    let _ = rustix::process::kill_process(rustix::process::Pid::from_raw(vm.supervisor.id() as i32).unwrap(), rustix::process::Signal::TERM);
    let st = vm.supervisor.wait().unwrap();
    eprintln!("policy: {:.1?} (supervisor of u: {st})", t.elapsed());
}

impl Fixture {
    /// SIGHUP: the broker reads its policy file again.
    fn broker_reload(&self) {
        rustix::process::kill_process(rustix::process::Pid::from_raw(self.broker.id() as i32).unwrap(), rustix::process::Signal::HUP).unwrap();
        // The reload is asynchronous: give the broker a moment.
        std::thread::sleep(Duration::from_millis(500));
    }
}
