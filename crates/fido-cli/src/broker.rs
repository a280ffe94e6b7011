//! `fido broker`: the broker in the foreground until SIGINT/SIGTERM.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use fido_broker::{Broker, Config};
use signal_hook::consts::{SIGINT, SIGTERM};

/// `$XDG_STATE_HOME/fido`, else `/var/lib/fido` as root, else `~/.local/state/fido`.
pub fn default_state_dir() -> anyhow::Result<PathBuf> {
    if let Some(d) = std::env::var_os("XDG_STATE_HOME").filter(|d| !d.is_empty()) {
        return Ok(PathBuf::from(d).join("fido"));
    }
    if rustix::process::geteuid().is_root() {
        return Ok("/var/lib/fido".into());
    }
    let home = std::env::var_os("HOME")
        .filter(|h| !h.is_empty())
        .context("HOME is not set; pass --state-dir")?;
    Ok(PathBuf::from(home).join(".local/state/fido"))
}

pub struct BrokerArgs {
    pub state_dir: Option<PathBuf>,
    pub socket: Option<PathBuf>,
    pub heartbeat_ms: Option<u64>,
    pub heartbeat_misses: Option<u32>,
    /// Access policy (TOML); without it only the broker's own uid may join.
    pub policy: Option<PathBuf>,
    /// Pipe engine settings (`--pipe-capacity`, `--pipe-strict`, `--pipe-lanes`).
    pub pipe: fido_broker::PipeConfig,
}

pub fn run(a: BrokerArgs) -> anyhow::Result<()> {
    let socket = a.socket.unwrap_or_else(Config::default_socket);
    let state = match a.state_dir {
        Some(d) => d,
        None => default_state_dir()?,
    };
    let mut config = Config::new(&socket, &state);
    config.pipe = a.pipe.clone();
    if let Some(ms) = a.heartbeat_ms {
        config.heartbeat = Duration::from_millis(ms);
    }
    if let Some(n) = a.heartbeat_misses {
        config.heartbeat_misses = n;
    }
    let policy_note = match &a.policy {
        Some(path) => {
            // A policy that does not load is fatal: never fall back to another one.
            let p = fido_broker::Policy::load(path)
                .map_err(|e| anyhow::anyhow!("{e}"))
                .context("refusing to start: the policy file is invalid")?;
            let note = format!("policy {} ({} rules)", path.display(), p.rules.len());
            config.policy = std::sync::Arc::new(p);
            note
        }
        None => format!(
            "built-in default policy: only uid {} may join",
            rustix::process::geteuid().as_raw()
        ),
    };
    let broker = Broker::bind(config).context("starting the broker")?;
    let handle = broker.shutdown_handle();
    let mut signals = signal_hook::iterator::Signals::new([SIGINT, SIGTERM])
        .context("installing signal handlers")?;
    let signal_handle = signals.handle();
    let waiter = std::thread::Builder::new()
        .name("fido-signals".into())
        .spawn(move || {
            if let Some(sig) = signals.forever().next() {
                tracing::info!(signal = sig, "shutting down");
                handle.shutdown();
            }
        })?;
    eprintln!(
        "fido broker: listening on {} (state in {}; {policy_note})",
        socket.display(),
        state.display()
    );
    let r = broker.run();
    signal_handle.close();
    let _ = waiter.join();
    r.context("broker")?;
    eprintln!("fido broker: stopped");
    Ok(())
}
