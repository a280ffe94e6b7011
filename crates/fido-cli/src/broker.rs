//! `fido broker`: the broker in the foreground until SIGINT/SIGTERM; SIGHUP
//! reloads the policy file (a file that does not load keeps the old policy).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use fido_broker::{Broker, Config};
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};

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

/// SIGHUP: reads the policy file again and hands it to the broker. Without a
/// file the built-in default stays; a file that does not load is reported and
/// the running policy stays (never fall back to something more permissive).
fn reload_policy(path: Option<&std::path::Path>, reload: &fido_broker::ReloadHandle) {
    let Some(path) = path else {
        eprintln!("fido broker: SIGHUP ignored: no --policy file to reload (built-in default stays)");
        return;
    };
    match fido_broker::Policy::load(path) {
        Ok(p) => {
            eprintln!("fido broker: reloading policy {} ({} rules)", path.display(), p.rules.len());
            reload.reload(p);
        }
        Err(e) => {
            tracing::error!(policy = %path.display(), error = %e, "policy reload refused; the running policy stays");
            eprintln!("fido broker: policy reload refused, the running policy stays: {e}");
        }
    }
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
    // Pipes hold the descriptors clients hand over (two per pipe, two more
    // per running transfer): raise the soft descriptor limit to the hard one.
    let lim = rustix::process::getrlimit(rustix::process::Resource::Nofile);
    if lim.current < lim.maximum {
        let raised = rustix::process::Rlimit { current: lim.maximum, maximum: lim.maximum };
        if let Err(e) = rustix::process::setrlimit(rustix::process::Resource::Nofile, raised) {
            tracing::warn!(error = %e, "could not raise the descriptor limit");
        }
    }
    let broker = Broker::bind(config).context("starting the broker")?;
    let handle = broker.shutdown_handle();
    let reload = broker.reload_handle();
    let policy_path = a.policy.clone();
    let mut signals = signal_hook::iterator::Signals::new([SIGINT, SIGTERM, SIGHUP])
        .context("installing signal handlers")?;
    let signal_handle = signals.handle();
    let waiter = std::thread::Builder::new()
        .name("fido-signals".into())
        .spawn(move || {
            for sig in signals.forever() {
                if sig != SIGHUP {
                    tracing::info!(signal = sig, "shutting down");
                    handle.shutdown();
                    return;
                }
                reload_policy(policy_path.as_deref(), &reload);
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
