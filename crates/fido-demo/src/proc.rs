//! Helper processes and the things that must never be left behind.
//!
//! * [`Kid`]: a re-executed copy of this binary (`fido <hidden subcommand> ...`)
//!   whose stdout is read line by line on a helper thread. It is killed and
//!   reaped when dropped, whatever path drops it; the child itself asks the
//!   kernel to kill it if we die ([`child_prologue`]: `PR_SET_PDEATHSIG`).
//! * [`EmbeddedBroker`]: a broker thread on a socket inside a temporary
//!   directory; dropping it shuts the broker down (socket removed) and then
//!   removes the directory.
//! * [`interrupted`]: SIGINT/SIGTERM set a flag the long-running commands poll;
//!   a second signal exits at once (children still die by PDEATHSIG).

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, ExitCode, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context as _};

/// Environment variable carrying the spawning parent's pid to a helper.
pub const PARENT_ENV: &str = "FIDO_CLI_PARENT";

static INTERRUPT: OnceLock<Arc<AtomicBool>> = OnceLock::new();

/// Installs the SIGINT/SIGTERM flag (idempotent). First signal: set the flag;
/// second: exit with 130 at once.
pub fn install_interrupt_flag() -> anyhow::Result<()> {
    if INTERRUPT.get().is_some() {
        return Ok(());
    }
    let flag = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        // Order matters: the conditional exit sees the flag set by an earlier signal.
        signal_hook::flag::register_conditional_shutdown(sig, 130, flag.clone())?;
        signal_hook::flag::register(sig, flag.clone())?;
    }
    let _ = INTERRUPT.set(flag);
    Ok(())
}

/// How a hidden helper subcommand (a re-executed copy of `prog`) ends: its
/// error, if any, printed as `PROG SUBCOMMAND ARGS: error` on stderr (where the
/// parent collects it) and a failing exit status.
pub fn helper_exit(prog: &str, args: &[String], result: anyhow::Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{prog} {}: {e:#}", args.iter().take(3).cloned().collect::<Vec<_>>().join(" "));
            ExitCode::FAILURE
        }
    }
}

/// Whether SIGINT or SIGTERM arrived (always false before [`install_interrupt_flag`]).
pub fn interrupted() -> bool {
    INTERRUPT.get().is_some_and(|f| f.load(Ordering::SeqCst))
}

/// Fails if interrupted.
pub fn check_interrupt() -> anyhow::Result<()> {
    if interrupted() {
        bail!("interrupted");
    }
    Ok(())
}

/// First thing a helper process does: die with the parent (SIGKILL), and refuse
/// to run if the parent is already gone (the signal would never come).
pub fn child_prologue() -> anyhow::Result<()> {
    rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL))?;
    if let Ok(p) = std::env::var(PARENT_ENV) {
        let want: i32 = p.parse().context("bad FIDO_CLI_PARENT")?;
        let ppid = rustix::process::getppid().map(|p| p.as_raw_nonzero().get());
        if ppid != Some(want) {
            bail!("helper: parent {want} already gone");
        }
    }
    Ok(())
}

/// A line printed by a helper, or its stdout closing (`None`).
type Line = Option<String>;

/// A helper process running this binary.
pub struct Kid {
    child: Option<Child>,
    what: String,
    lines: mpsc::Receiver<Line>,
    reader: Option<JoinHandle<()>>,
    eof: bool,
}

impl Kid {
    /// Spawns `current_exe args...` with `FIDO_BROKER=broker`, stdout piped
    /// (read on a helper thread), stderr inherited.
    pub fn spawn(args: &[String], broker: &Path) -> anyhow::Result<Kid> {
        Self::spawn_with(args, Some(broker))
    }

    /// [`Kid::spawn`] for a helper that does not talk to a broker.
    pub fn spawn_without_broker(args: &[String]) -> anyhow::Result<Kid> {
        Self::spawn_with(args, None)
    }

    fn spawn_with(args: &[String], broker: Option<&Path>) -> anyhow::Result<Kid> {
        Self::spawn_wrapped(&[], args, broker)
    }

    /// [`Kid::spawn`] through `wrapper` (a command that runs the rest in
    /// place, by exec, such as `ip netns exec NS`): `wrapper... current_exe
    /// args...`. The helper's parent is still this process.
    pub fn spawn_wrapped(wrapper: &[String], args: &[String], broker: Option<&Path>) -> anyhow::Result<Kid> {
        let exe = std::env::current_exe().context("current_exe")?;
        let mut cmd = match wrapper.split_first() {
            Some((first, rest)) => {
                let mut c = Command::new(first);
                c.args(rest).arg(exe);
                c
            }
            None => Command::new(exe),
        };
        if let Some(b) = broker {
            cmd.env("FIDO_BROKER", b);
        }
        cmd.args(args).env(PARENT_ENV, std::process::id().to_string());
        Self::spawn_command(cmd, format!("fido {}", args.join(" ")))
    }

    /// Spawns another program, `program args...`, as a helper (stdout read
    /// line by line, stderr inherited, killed and reaped when dropped). It
    /// dies with this process only if it sees to that itself (or runs under
    /// `setpriv --pdeathsig KILL`).
    pub fn spawn_program(program: &str, args: &[String]) -> anyhow::Result<Kid> {
        let mut cmd = Command::new(program);
        cmd.args(args);
        Self::spawn_command(cmd, format!("{program} {}", args.join(" ")))
    }

    fn spawn_command(mut cmd: Command, what: String) -> anyhow::Result<Kid> {
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut child = cmd.spawn().with_context(|| format!("spawning `{what}`"))?;
        let out = child.stdout.take().expect("piped");
        let (tx, rx) = mpsc::channel();
        let reader = read_lines(&mut child, "fido-kid-stdout".into(), out, move |line| {
            let eof = line.is_none();
            tx.send(line).is_ok() && !eof
        })?;
        Ok(Kid {
            child: Some(child),
            what,
            lines: rx,
            reader: Some(reader),
            eof: false,
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().map(|c| c.id()).unwrap_or(0)
    }

    /// The helper's exit status if it has exited (it is reaped then).
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child.as_mut().and_then(|c| c.try_wait().ok().flatten())
    }

    /// The next non-empty stdout line, waiting until `deadline` (and failing on
    /// interrupt, EOF or the deadline).
    pub fn next_line(&mut self, deadline: Instant) -> anyhow::Result<String> {
        loop {
            check_interrupt()?;
            if self.eof {
                let note = self.status_note();
                bail!("`{}` exited without reporting{note}", self.what);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                bail!("`{}` reported nothing in time", self.what);
            }
            match self.lines.recv_timeout(left.min(Duration::from_millis(50))) {
                Ok(Some(line)) if line.trim().is_empty() => {}
                Ok(Some(line)) => return Ok(line),
                Ok(None) | Err(mpsc::RecvTimeoutError::Disconnected) => self.eof = true,
                Err(mpsc::RecvTimeoutError::Timeout) => {}
            }
        }
    }

    /// The next non-empty stdout line if one comes within `wait`, else
    /// `None` (failing on interrupt or EOF): for watching a helper that
    /// reports now and then while waiting for something else.
    pub fn poll_line(&mut self, wait: Duration) -> anyhow::Result<Option<String>> {
        let until = Instant::now() + wait;
        loop {
            check_interrupt()?;
            if self.eof {
                let note = self.status_note();
                bail!("`{}` exited{note}", self.what);
            }
            let left = until.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left.min(Duration::from_millis(50))) {
                Ok(Some(line)) if line.trim().is_empty() => {}
                Ok(Some(line)) => return Ok(Some(line)),
                Ok(None) | Err(mpsc::RecvTimeoutError::Disconnected) => self.eof = true,
                Err(mpsc::RecvTimeoutError::Timeout) if left.is_zero() => return Ok(None),
                Err(mpsc::RecvTimeoutError::Timeout) => {}
            }
        }
    }

    /// The next stdout line parsed as JSON, waiting until `deadline` (and
    /// failing on interrupt, EOF or the deadline).
    pub fn next_json(&mut self, deadline: Instant) -> anyhow::Result<serde_json::Value> {
        loop {
            check_interrupt()?;
            if self.eof {
                let note = self.status_note();
                bail!("`{}` exited without reporting{note}", self.what);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                bail!("`{}` reported nothing in time", self.what);
            }
            match self.lines.recv_timeout(left.min(Duration::from_millis(50))) {
                Ok(Some(line)) => {
                    if line.trim().is_empty() {
                        continue;
                    }
                    return serde_json::from_str(&line).with_context(|| {
                        format!("`{}` printed a non-JSON line: {line}", self.what)
                    });
                }
                Ok(None) | Err(mpsc::RecvTimeoutError::Disconnected) => self.eof = true,
                Err(mpsc::RecvTimeoutError::Timeout) => {}
            }
        }
    }

    /// Waits for a JSON line whose `"event"` is `event`.
    pub fn expect_event(
        &mut self,
        event: &str,
        deadline: Instant,
    ) -> anyhow::Result<serde_json::Value> {
        let v = self.next_json(deadline)?;
        if v.get("event").and_then(|e| e.as_str()) != Some(event) {
            bail!("`{}`: expected a `{event}` line, got {v}", self.what);
        }
        Ok(v)
    }

    fn status_note(&mut self) -> String {
        let Some(c) = self.child.as_mut() else {
            return String::new();
        };
        // Stdout closed: the process is exiting; give it a moment.
        for _ in 0..100 {
            if let Ok(Some(st)) = c.try_wait() {
                return format!(" ({st})");
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        String::new()
    }

    /// Waits up to `timeout` for the helper to exit successfully; kills it and
    /// fails otherwise. Always reaps.
    pub fn finish(mut self, timeout: Duration) -> anyhow::Result<ExitStatus> {
        let mut child = self.child.take().expect("not finished twice");
        let deadline = Instant::now() + timeout;
        let status = loop {
            if let Some(st) = child.try_wait()? {
                break st;
            }
            if Instant::now() > deadline || interrupted() {
                let _ = child.kill();
                let _ = child.wait();
                if interrupted() {
                    bail!("interrupted");
                }
                bail!("`{}` did not exit within {timeout:?}; killed", self.what);
            }
            std::thread::sleep(Duration::from_millis(2));
        };
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
        if !status.success() {
            bail!("`{}` exited with {status}", self.what);
        }
        Ok(status)
    }
}

impl Drop for Kid {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        if let Some(r) = self.reader.take() {
            // The pipe closed with the process; the reader ends.
            let _ = r.join();
        }
    }
}

/// Finishes every helper (in order), keeping the first error; all are reaped.
pub fn finish_all(kids: Vec<Kid>, timeout: Duration) -> anyhow::Result<()> {
    let mut first: Option<anyhow::Error> = None;
    for k in kids {
        if let Err(e) = k.finish(timeout) {
            first.get_or_insert(e);
        }
    }
    first.map_or(Ok(()), Err)
}

/// A broker on its own thread, in a temporary directory it owns.
pub struct EmbeddedBroker {
    broker: Option<fido_broker::Embedded>,
    dir: Option<tempfile::TempDir>,
}

impl EmbeddedBroker {
    pub fn start(prefix: &str) -> anyhow::Result<EmbeddedBroker> {
        Self::start_with_pipe(prefix, fido_broker::PipeConfig::default())
    }

    /// [`EmbeddedBroker::start`] with the pipe engine configured as `pipe`.
    pub fn start_with_pipe(prefix: &str, pipe: fido_broker::PipeConfig) -> anyhow::Result<EmbeddedBroker> {
        let dir = tempfile::Builder::new()
            .prefix(prefix)
            .tempdir()
            .context("creating a temporary directory")?;
        let socket = dir.path().join("broker.sock");
        let mut config = fido_broker::Config::new(&socket, dir.path().join("state"));
        config.pipe = pipe;
        let broker = fido_broker::Embedded::start(config).context("starting the embedded broker")?;
        Ok(EmbeddedBroker {
            broker: Some(broker),
            dir: Some(dir),
        })
    }

    pub fn socket(&self) -> &Path {
        self.broker
            .as_ref()
            .expect("an EmbeddedBroker is only stopped by stop(self)")
            .socket()
    }

    /// Stops the broker, waits for it, removes the directory.
    pub fn stop(mut self) -> anyhow::Result<()> {
        self.stop_inner()
    }

    fn stop_inner(&mut self) -> anyhow::Result<()> {
        let r = match self.broker.take() {
            Some(b) => b.stop().map_err(|e| anyhow!("embedded broker: {e}")),
            None => Ok(()),
        };
        if let Some(d) = self.dir.take() {
            let path = d.path().to_path_buf();
            d.close()
                .with_context(|| format!("removing {}", path.display()))?;
        }
        r
    }
}

impl Drop for EmbeddedBroker {
    fn drop(&mut self) {
        if self.broker.is_some() || self.dir.is_some() {
            if let Err(e) = self.stop_inner() {
                eprintln!("fido: {e:#}");
            }
        }
    }
}

/// Whether a broker answers on `path` (a `SOCK_SEQPACKET` connect succeeds).
pub fn broker_reachable(path: &Path) -> bool {
    use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
    let Ok(addr) = SocketAddrUnix::new(path) else {
        return false;
    };
    let Ok(s) = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC,
        None,
    ) else {
        return false;
    };
    rustix::net::connect(&s, &addr).is_ok()
}

/// Reads `out` (a child's stdout) line by line on a thread named `name`,
/// handing each line (trimmed) to `on_line`, then `None` at end of file; stops
/// early when `on_line` returns false. If the thread cannot be started the
/// child is killed and reaped, so no child outlives a failed spawn.
pub fn read_lines(
    child: &mut std::process::Child,
    name: String,
    out: impl std::io::Read + Send + 'static,
    mut on_line: impl FnMut(Option<String>) -> bool + Send + 'static,
) -> anyhow::Result<std::thread::JoinHandle<()>> {
    let spawned = std::thread::Builder::new().name(name).spawn(move || {
        let mut r = BufReader::new(out);
        loop {
            let mut s = String::new();
            let line = match r.read_line(&mut s) {
                Ok(0) | Err(_) => None,
                Ok(_) => Some(s.trim_end().to_string()),
            };
            let eof = line.is_none();
            if !on_line(line) || eof {
                return;
            }
        }
    });
    spawned.map_err(|e| {
        let _ = child.kill();
        let _ = child.wait();
        e.into()
    })
}
