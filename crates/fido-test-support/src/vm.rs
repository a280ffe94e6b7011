//! The test guest of the VM-domain tests: its image (built by
//! `scripts/vm-image.sh`, once per process and under a file lock across
//! processes), a plain QEMU launcher ([`boot_plain`]) and the guest's serial
//! console as a command runner ([`Console`]).
//!
//! The guest is the busybox initramfs of `scripts/vm-image.sh`: a root shell on
//! ttyS0 whose prompt is `fido-guest# `, the workspace's `fido` at /bin/fido,
//! virtio and VFIO modules loaded. [`Console::run`] runs one command there and
//! returns its exit status and output, found between markers that the
//! terminal's echo of the command line cannot produce.

use std::collections::HashMap;
use std::ffi::OsString;
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How long a boot may take before [`boot_plain`] gives up: generous, TCG on a
/// loaded 2-core machine is slow (an idle one reaches the shell in ~3 s).
pub const BOOT_TIMEOUT: Duration = Duration::from_secs(120);

/// The CPU model of the tests' plain TCG guests: `fido_vm::qemu::TCG_CPU`,
/// which says why (this crate cannot depend on fido-vm, whose tests use it;
/// `crates/fido-vm/tests/qemu.rs` checks that the two agree).
pub const TCG_CPU: &str = "max,erms=off,fsrm=off";

/// The `-smp` of the tests' plain TCG guests: `fido_vm::qemu::tcg_smp`, which
/// says why (at least two possible CPUs, else QEMU drops the guest's memory
/// barriers); checked equal by `crates/fido-vm/tests/qemu.rs`.
pub fn tcg_smp(cpus: u32) -> String {
    format!("{cpus},maxcpus={}", cpus.max(2))
}

/// A bootable guest: what `scripts/vm-image.sh` wrote.
#[derive(Clone, Debug)]
pub struct Image {
    /// The kernel: an uncompressed vmlinux (PVH boot), or a bzImage.
    pub kernel: PathBuf,
    /// The initramfs (gzip'd newc cpio).
    pub initrd: PathBuf,
    /// The kernel command line the image is meant to boot with.
    pub cmdline: String,
    /// The directory holding them (and `manifest`, what is inside).
    pub dir: PathBuf,
}

/// Is QEMU (qemu-system-x86_64) on PATH? VM tests skip, saying so, when not.
pub fn qemu_available() -> bool {
    crate::wait::have("qemu-system-x86_64")
}

/// The workspace root (this crate lives at crates/fido-test-support).
fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The cargo profile directory this test binary runs from (target/release
/// for target/release/deps/NAME-HASH), where the workspace's `fido` is.
fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let deps = exe.parent().expect("test binary has a directory");
    let dir = if deps.file_name().is_some_and(|n| n == "deps") {
        deps.parent().expect("deps has a parent")
    } else {
        deps
    };
    dir.to_path_buf()
}

/// Where the default image goes: `FIDO_VM_IMAGE_DIR`, else target/vm-image.
fn default_image_dir() -> PathBuf {
    match std::env::var_os("FIDO_VM_IMAGE_DIR") {
        Some(p) => PathBuf::from(p),
        None => profile_dir()
            .parent()
            .expect("profile dir has a parent")
            .join("vm-image"),
    }
}

/// The test guest with the workspace's `fido`, built (or found up to date)
/// once per process. Panics with the script's output if it cannot be built.
pub fn image() -> Image {
    static DEFAULT: OnceLock<Image> = OnceLock::new();
    DEFAULT
        .get_or_init(|| build_image(&default_image_dir(), &[]))
        .clone()
}

/// The test guest with more files: each `(src, dst)` puts the host file `src`
/// at the absolute guest path `dst` (ELF programs with their shared
/// libraries). Built in its own directory beside the default image (named by
/// the destinations), once per process per set of files.
pub fn image_with(files: &[(PathBuf, &str)]) -> Image {
    static WITH: OnceLock<Mutex<HashMap<String, Image>>> = OnceLock::new();
    let spec: String = files
        .iter()
        .map(|(s, d)| format!("{}:{d}\n", s.display()))
        .collect();
    let mut built = WITH
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some(img) = built.get(&spec) {
        return img.clone();
    }
    let name: String = files
        .iter()
        .map(|(_, d)| {
            d.trim_start_matches('/')
                .replace(|c: char| !c.is_ascii_alphanumeric(), "_")
        })
        .collect::<Vec<_>>()
        .join("+");
    let base = default_image_dir();
    let dir = base.with_file_name(format!(
        "{}-{}",
        base.file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("vm-image"),
        &name[..name.len().min(80)]
    ));
    let img = build_image(&dir, files);
    built.insert(spec, img.clone());
    img
}

/// Runs scripts/vm-image.sh into `out` under an exclusive lock on
/// `out.lock` (parallel test binaries wait for one build instead of racing).
fn build_image(out: &Path, files: &[(PathBuf, &str)]) -> Image {
    std::fs::create_dir_all(out.parent().expect("image dir has a parent"))
        .unwrap_or_else(|e| panic!("creating {}: {e}", out.display()));
    let mut lock_path = out.as_os_str().to_owned();
    lock_path.push(".lock");
    let lock = File::create(&lock_path)
        .unwrap_or_else(|e| panic!("creating {}: {e}", Path::new(&lock_path).display()));
    rustix::fs::flock(&lock, rustix::fs::FlockOperation::LockExclusive)
        .unwrap_or_else(|e| panic!("locking {}: {e}", Path::new(&lock_path).display()));

    let script = workspace_root().join("scripts/vm-image.sh");
    let mut cmd = Command::new("bash");
    cmd.arg(&script)
        .arg("--out")
        .arg(out)
        .current_dir(workspace_root())
        .stdin(Stdio::null());
    // The `fido` that goes into the guest: FIDO_VM_FIDO if set, else the
    // script's default, release/fido in this test binary's target directory
    // (which it builds when missing).
    match std::env::var_os("FIDO_VM_FIDO") {
        Some(fido) => cmd.arg("--fido").arg(fido),
        None => cmd.env(
            "CARGO_TARGET_DIR",
            profile_dir().parent().expect("target dir"),
        ),
    };
    for (src, dst) in files {
        let mut spec = OsString::from(src.as_os_str());
        spec.push(":");
        spec.push(dst);
        cmd.arg("--add").arg(spec);
    }
    let started = Instant::now();
    let output = cmd
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", script.display()));
    drop(lock);
    let log = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "{} failed ({}):\n{log}{}",
        script.display(),
        output.status,
        String::from_utf8_lossy(&output.stdout)
    );
    if started.elapsed() > Duration::from_secs(2) {
        eprintln!(
            "vm image {} ready in {:.1?}",
            out.display(),
            started.elapsed()
        );
    }
    let cmdline = std::fs::read_to_string(out.join("cmdline"))
        .unwrap_or_else(|e| panic!("{}/cmdline: {e}\n{log}", out.display()));
    Image {
        kernel: out.join("kernel"),
        initrd: out.join("initrd.img"),
        cmdline: cmdline.trim().to_owned(),
        dir: out.to_path_buf(),
    }
}

/// What the console has received so far, appended by a reader thread (so
/// QEMU never blocks on a full socket), with the reader's end noted.
struct Received {
    bytes: Vec<u8>,
    closed: Option<String>,
}

/// The guest's serial console on a Unix socket (QEMU's `-chardev
/// socket,server=on`): a reader thread collects everything the guest prints;
/// commands are written to the socket.
pub struct Console {
    stream: UnixStream,
    received: Arc<(Mutex<Received>, Condvar)>,
    /// Where in `received.bytes` the next marker search starts.
    cursor: usize,
    /// Sequence number of the next command's markers.
    seq: u64,
}

/// The longest command line [`Console::run`] sends: a terminal in canonical
/// mode holds 4095 bytes of a line.
pub const MAX_COMMAND: usize = 3500;

impl Console {
    /// Connects to the console socket at `path`, retrying until QEMU has
    /// created it (up to `timeout`).
    pub fn connect(path: &Path, timeout: Duration) -> io::Result<Console> {
        let deadline = Instant::now() + timeout;
        let stream = loop {
            match UnixStream::connect(path) {
                Ok(s) => break s,
                Err(e) if Instant::now() >= deadline => {
                    return Err(io::Error::new(
                        e.kind(),
                        format!("console {}: {e}", path.display()),
                    ))
                }
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        };
        let received = Arc::new((
            Mutex::new(Received {
                bytes: Vec::new(),
                closed: None,
            }),
            Condvar::new(),
        ));
        let mut reader = stream.try_clone()?;
        let shared = Arc::clone(&received);
        std::thread::Builder::new()
            .name("vm-console".into())
            .spawn(move || {
                let mut buf = [0u8; 4096];
                loop {
                    let end = match reader.read(&mut buf) {
                        Ok(0) => Some("closed by QEMU".to_owned()),
                        Ok(n) => {
                            let (lock, cv) = &*shared;
                            lock.lock()
                                .unwrap_or_else(|e| e.into_inner())
                                .bytes
                                .extend_from_slice(&buf[..n]);
                            cv.notify_all();
                            None
                        }
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => None,
                        Err(e) => Some(format!("read error: {e}")),
                    };
                    if let Some(why) = end {
                        let (lock, cv) = &*shared;
                        lock.lock().unwrap_or_else(|e| e.into_inner()).closed = Some(why);
                        cv.notify_all();
                        return;
                    }
                }
            })?;
        Ok(Console {
            stream,
            received,
            cursor: 0,
            seq: 0,
        })
    }

    /// Everything the guest printed since the connection (for failure messages).
    pub fn transcript(&self) -> String {
        let (lock, _) = &*self.received;
        String::from_utf8_lossy(&lock.lock().unwrap_or_else(|e| e.into_inner()).bytes).into_owned()
    }

    /// Waits until `found` finds something in what arrived after the cursor,
    /// returning its result; moves nothing. Errors at `deadline` or when the
    /// console closed.
    fn wait_until<T>(
        &self,
        deadline: Instant,
        what: &str,
        mut found: impl FnMut(&[u8]) -> Option<T>,
    ) -> io::Result<T> {
        let (lock, cv) = &*self.received;
        let mut got = lock.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(t) = found(&got.bytes[self.cursor.min(got.bytes.len())..]) {
                return Ok(t);
            }
            if let Some(why) = &got.closed {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("console {why} while waiting for {what}"),
                ));
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("timed out waiting for {what}"),
                ));
            }
            got = cv
                .wait_timeout(got, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Writes a line to the guest's terminal, after ^U (which erases whatever
    /// partial line an earlier, cut-off write left in the terminal's buffer).
    fn send_line(&mut self, line: &str) -> io::Result<()> {
        let mut bytes = Vec::with_capacity(line.len() + 2);
        bytes.push(0x15);
        bytes.extend_from_slice(line.as_bytes());
        bytes.push(b'\n');
        self.stream.write_all(&bytes)
    }

    /// Waits until the shell answers: sends an echo with a fresh marker every
    /// second (a line written while the guest is still booting may be lost)
    /// until one comes back, then turns the terminal's echo off.
    pub fn wait_for_shell(&mut self, timeout: Duration) -> io::Result<()> {
        let deadline = Instant::now() + timeout;
        let mut probe = 0u64;
        loop {
            probe += 1;
            // `FIDO''READY` comes back as FIDOREADY; the echoed input does not.
            // Each probe starts with ^C: while the guest boots, the serial
            // line can drop the start of a probe, and a lost `echo FIDO'`
            // left the shell inside an open quote, taking every later probe
            // as more of the same string. ^C discards whatever the shell
            // has half read.
            let marker = format!("FIDOREADY-{}-{probe}\r", std::process::id());
            self.send_line(&format!("\x03echo FIDO''READY-{}-{probe}", std::process::id()))?;
            let wait_end = deadline.min(Instant::now() + Duration::from_secs(1));
            match self.wait_until(wait_end, "the shell", |b| {
                find(b, marker.as_bytes()).map(|i| i + marker.len())
            }) {
                Ok(end) => {
                    self.cursor += end;
                    break;
                }
                Err(e) if e.kind() == io::ErrorKind::TimedOut && Instant::now() < deadline => {
                    continue
                }
                Err(e) => return Err(e),
            }
        }
        // Earlier probes may still be queued; the first `run` skips their output.
        let remaining = deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_secs(10));
        let (code, _) = self.run("stty -echo", remaining)?;
        if code != 0 {
            return Err(io::Error::other(format!("stty -echo exited {code}")));
        }
        Ok(())
    }

    /// Runs `cmd` in the guest's shell (`eval`ed, so `cd` and variables
    /// persist) and returns its exit status and its output (stdout and stderr
    /// together, `\r\n` turned into `\n`, kernel log lines (`[  12.345] ...`)
    /// removed). Errors when the status does not come back within `timeout`;
    /// the command may then still be running in the guest.
    pub fn run(&mut self, cmd: &str, timeout: Duration) -> io::Result<(i32, String)> {
        let quoted = format!("'{}'", cmd.replace('\'', r"'\''"));
        if quoted.len() > MAX_COMMAND || cmd.contains('\n') {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("command longer than {MAX_COMMAND} bytes or multi-line: {cmd:.80}"),
            ));
        }
        self.seq += 1;
        let n = self.seq;
        let begin = format!("FIDOBEGIN-{n}\r\n");
        let end = format!("FIDOEND-{n}-");
        self.send_line(&format!(
            "echo FIDO''BEGIN-{n}; eval {quoted}; echo FIDO''END-{n}-$?"
        ))?;
        let deadline = Instant::now() + timeout;
        let (out_start, out_end, code, after) =
            self.wait_until(deadline, &format!("the end of `{cmd:.80}`"), |b| {
                let s = find(b, begin.as_bytes())? + begin.len();
                let e = s + find(&b[s..], end.as_bytes())?;
                let digits_at = e + end.len();
                let line_end = digits_at + find(&b[digits_at..], b"\n")?;
                let code: i32 = std::str::from_utf8(&b[digits_at..line_end])
                    .ok()?
                    .trim()
                    .parse()
                    .ok()?;
                Some((s, e, code, line_end + 1))
            })?;
        let out = {
            let (lock, _) = &*self.received;
            let got = lock.lock().unwrap_or_else(|e| e.into_inner());
            let base = self.cursor;
            clean_output(&got.bytes[base + out_start..base + out_end])
        };
        self.cursor += after;
        Ok((code, out))
    }

    /// Like [`Console::run`], but an error or a non-zero status is a panic
    /// naming the command, with its output; returns the output.
    pub fn run_ok(&mut self, cmd: &str, timeout: Duration) -> String {
        match self.run(cmd, timeout) {
            Ok((0, out)) => out,
            Ok((code, out)) => panic!("guest: `{cmd}` exited {code}:\n{out}"),
            Err(e) => {
                // The kernel's log says why a shell died or a command hung
                // (the console shows only emergencies unless fido.verbose).
                let _ = self.interrupt();
                let kernel = match self.run("dmesg | tail -n 60", Duration::from_secs(15)) {
                    Ok((_, out)) => out,
                    Err(e) => format!("(dmesg: {e})"),
                };
                panic!(
                    "guest: `{cmd}`: {e}\nconsole transcript:\n{}\nguest kernel log (tail):\n{kernel}",
                    self.transcript()
                )
            }
        }
    }

    /// Sends ^C: interrupts the foreground command (after a `run` timed out).
    pub fn interrupt(&mut self) -> io::Result<()> {
        self.stream.write_all(&[0x03])
    }

    /// Starts `cmd` in the background in the guest, its output going to
    /// `/tmp/spawn-N.log` (N returned with the pid), stdin from /dev/null.
    ///
    /// The command is not a job of the console's shell: a subshell starts it
    /// and exits, so it belongs to init. With `stty -echo` busybox's shell
    /// reads its input with `fgets`, and the SIGCHLD of a job that ends
    /// while the shell waits for input makes that read fail: the shell
    /// exits (init starts another) and a command typed meanwhile is lost.
    pub fn spawn(&mut self, cmd: &str) -> io::Result<Spawned> {
        let log = format!("/tmp/spawn-{}.log", self.seq + 1);
        let quoted = format!("'{}'", cmd.replace('\'', r"'\''"));
        let (code, out) = self.run(
            &format!("(sh -c {quoted} >{log} 2>&1 </dev/null & echo $!)"),
            Duration::from_secs(30),
        )?;
        let pid = out
            .trim()
            .parse()
            .ok()
            .filter(|_| code == 0)
            .ok_or_else(|| {
                io::Error::other(format!("spawning `{cmd}`: exit {code}, output {out:?}"))
            })?;
        Ok(Spawned { pid, log })
    }
}

impl Drop for Console {
    fn drop(&mut self) {
        // Ends the reader thread (its clone of the socket reads EOF).
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
    }
}

/// A background command in the guest ([`Console::spawn`]).
#[derive(Clone, Debug)]
pub struct Spawned {
    /// Its pid in the guest.
    pub pid: u32,
    /// The guest file its stdout and stderr go to.
    pub log: String,
}

/// The first position of `needle` in `hay`.
fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// Console bytes as text: `\r` dropped, kernel log lines removed.
fn clean_output(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes).replace('\r', "");
    let mut out = String::with_capacity(text.len());
    for line in text.split_inclusive('\n') {
        if !is_kernel_log_line(line) {
            out.push_str(line);
        }
    }
    out
}

/// `[    3.640872] text`: a printk line on the console.
fn is_kernel_log_line(line: &str) -> bool {
    let Some(rest) = line.strip_prefix('[') else {
        return false;
    };
    let Some((stamp, _)) = rest.split_once(']') else {
        return false;
    };
    let stamp = stamp.trim_start();
    !stamp.is_empty()
        && stamp.split_once('.').is_some_and(|(s, us)| {
            !s.is_empty()
                && s.bytes().all(|b| b.is_ascii_digit())
                && !us.is_empty()
                && us.bytes().all(|b| b.is_ascii_digit())
        })
}

/// How to boot a [`PlainVm`].
#[derive(Clone, Debug)]
pub struct BootOptions {
    /// Appended to the image's kernel command line (`fido.ip=...`, ...).
    pub extra_cmdline: String,
    /// Appended to QEMU's arguments (devices, objects, chardevs).
    pub extra_qemu_args: Vec<String>,
    /// Guest memory in MiB.
    pub memory_mib: u32,
    /// Virtual CPUs.
    pub cpus: u32,
    /// QEMU's `-smp` verbatim instead of [`tcg_smp`]`(cpus)` (the test that
    /// shows why a TCG guest needs two possible CPUs boots one with `1`).
    pub smp: Option<String>,
    /// Wait for the shell on the console (else return once QEMU runs; with
    /// `fido.run=` in `extra_cmdline` the guest runs that and powers off).
    pub wait_for_shell: bool,
}

impl Default for BootOptions {
    fn default() -> Self {
        BootOptions {
            extra_cmdline: String::new(),
            extra_qemu_args: Vec::new(),
            memory_mib: 256,
            cpus: 1,
            smp: None,
            wait_for_shell: true,
        }
    }
}

/// A guest started directly with QEMU (no supervisor): q35 with an emulated
/// Intel IOMMU (interrupt remapping on, so VFIO works in the guest), TCG,
/// serial console on a Unix socket in a private temporary directory. QEMU is
/// killed (by its pid) and reaped on drop.
pub struct PlainVm {
    child: Child,
    /// The guest's serial console.
    pub console: Console,
    /// Time from starting QEMU to the shell answering (zero if not waited for).
    pub boot_time: Duration,
    dir: tempfile::TempDir,
}

/// Boots `image` with `extra_qemu_args` and waits for its shell (panics, with
/// the console transcript and QEMU's output, if it does not come within
/// [`BOOT_TIMEOUT`]).
pub fn boot_plain(image: &Image, extra_qemu_args: &[String]) -> PlainVm {
    boot_with(
        image,
        &BootOptions {
            extra_qemu_args: extra_qemu_args.to_vec(),
            ..Default::default()
        },
    )
}

/// Boots `image` as `options` say.
pub fn boot_with(image: &Image, options: &BootOptions) -> PlainVm {
    let dir = tempfile::Builder::new()
        .prefix("fido-vm-")
        .tempdir()
        .expect("temp dir");
    let serial = dir.path().join("console.sock");
    let log_path = dir.path().join("qemu.log");
    let log = File::create(&log_path).expect("qemu log");
    let mut cmdline = image.cmdline.clone();
    if !options.extra_cmdline.is_empty() {
        cmdline.push(' ');
        cmdline.push_str(&options.extra_cmdline);
    }
    let mut cmd = Command::new("qemu-system-x86_64");
    cmd.args([
        "-machine",
        "q35",
        "-accel",
        "tcg,thread=multi",
        "-cpu",
        TCG_CPU,
    ])
    .args([
        "-m",
        &format!("{}M", options.memory_mib),
        "-smp",
        &options.smp.clone().unwrap_or_else(|| tcg_smp(options.cpus)),
    ])
    .args(["-nographic", "-nodefaults", "-no-user-config", "-no-reboot"])
    .args(["-device", "intel-iommu,intremap=on"])
    .arg("-chardev")
    .arg(format!(
        "socket,id=ser,path={},server=on,wait=off",
        serial.display()
    ))
    .args(["-serial", "chardev:ser"])
    .arg("-kernel")
    .arg(&image.kernel)
    .arg("-initrd")
    .arg(&image.initrd)
    .args(["-append", &cmdline])
    .args(&options.extra_qemu_args)
    .stdin(Stdio::null())
    .stdout(log.try_clone().expect("qemu log"))
    .stderr(log);
    let started = Instant::now();
    let child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("starting qemu-system-x86_64: {e}"));
    let mut vm = PlainVm {
        console: match Console::connect(&serial, Duration::from_secs(30)) {
            Ok(c) => c,
            Err(e) => {
                let mut child = child;
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "{e}\nqemu output:\n{}",
                    std::fs::read_to_string(&log_path).unwrap_or_default()
                );
            }
        },
        child,
        boot_time: Duration::ZERO,
        dir,
    };
    if options.wait_for_shell {
        if let Err(e) = vm.console.wait_for_shell(BOOT_TIMEOUT) {
            panic!(
                "guest shell: {e}\nconsole transcript:\n{}\nqemu output:\n{}",
                vm.console.transcript(),
                vm.qemu_output()
            );
        }
        vm.boot_time = started.elapsed();
    }
    vm
}

impl PlainVm {
    /// QEMU's pid.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The VM's private temporary directory (console socket, QEMU's log):
    /// a place for the test's own sockets.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// What QEMU printed on stdout and stderr.
    pub fn qemu_output(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("qemu.log")).unwrap_or_default()
    }

    /// Waits for QEMU to exit (the guest powered off); `None` after `timeout`.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().expect("waiting for qemu") {
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for PlainVm {
    fn drop(&mut self) {
        // SIGKILL to the pid we started, then reap it.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_log_lines_are_recognised() {
        assert!(is_kernel_log_line("[    3.640872] reboot: Power down\n"));
        assert!(is_kernel_log_line("[12345.000001] x"));
        assert!(!is_kernel_log_line("[ok] fine\n"));
        assert!(!is_kernel_log_line("[   .5] x"));
        assert!(!is_kernel_log_line("plain\n"));
        assert_eq!(
            clean_output(b"a\r\n[    1.000000] virtio: x\r\nb\r\n"),
            "a\nb\n"
        );
    }

    #[test]
    fn find_locates_markers() {
        assert_eq!(find(b"xxFIDOEND-1-0", b"FIDOEND-1-"), Some(2));
        assert_eq!(find(b"FIDO''END-1-", b"FIDOEND-1-"), None);
    }
}
