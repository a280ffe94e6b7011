//! `fido pipe ...`: the applications built on the pipe engine.
//!
//! * `fido pipe serve DIR --port P`: static files over HTTP/1.1, bodies moved
//!   file→socket by the engine ([`crate::pipe_serve`]).
//! * `fido pipe proxy LISTEN UPSTREAM`: a TCP forwarder, both directions moved
//!   socket→socket by the engine ([`crate::pipe_proxy`]).
//!
//! `--strategy sendfile|readwrite` runs the same program with the bytes moved in
//! this process instead (what `fido bench pipe` compares against).

use std::io::Write as _;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::Subcommand;

use crate::pipe_move::{self, Mover, Strategy};

#[derive(Subcommand)]
pub enum AppCmd {
    /// Serve DIR over HTTP/1.1 (GET/HEAD, keep-alive, ranges); bodies go file→socket through the broker's pipe engine.
    Serve {
        /// Directory to serve (nothing outside it is reachable, symlinks included).
        dir: PathBuf,
        /// TCP port (0: any free port; the chosen one is printed).
        #[arg(long)]
        port: u16,
        /// Address to listen on.
        #[arg(long, default_value = "127.0.0.1")]
        addr: IpAddr,
        /// Who moves the body bytes.
        #[arg(long, value_enum, default_value_t = Strategy::Fido)]
        strategy: Strategy,
        /// Close a connection idle (or not reading) for this many seconds.
        #[arg(long, default_value_t = 60)]
        idle_secs: u64,
        /// Connections served at once (more are answered 503).
        #[arg(long, default_value_t = 1024)]
        max_conns: usize,
    },
    /// Forward TCP connections from LISTEN to UPSTREAM; both directions go socket→socket through the broker's pipe engine.
    Proxy {
        /// Address to listen on, e.g. 127.0.0.1:8080 (port 0: any; printed).
        listen: String,
        /// Where to connect, e.g. 127.0.0.1:80.
        upstream: String,
        /// Who moves the bytes.
        #[arg(long, value_enum, default_value_t = Strategy::Fido)]
        strategy: Strategy,
    },
}

/// Builds the mover for `s`.
pub fn mover(s: Strategy) -> anyhow::Result<Arc<dyn Mover>> {
    Ok(match s {
        Strategy::Sendfile => Arc::new(pipe_move::Sendfile),
        Strategy::Readwrite => Arc::new(pipe_move::ReadWrite),
        Strategy::Fido => crate::pipe_fido::mover()?,
    })
}

pub fn run(cmd: AppCmd) -> anyhow::Result<()> {
    match cmd {
        AppCmd::Serve {
            dir,
            port,
            addr,
            strategy,
            idle_secs,
            max_conns,
        } => {
            let m = match strategy {
                Strategy::Fido => {
                    crate::pipe_fido::mover_with_stall(Duration::from_secs(idle_secs.max(1)))?
                }
                s => mover(s)?,
            };
            let cfg = crate::pipe_serve::ServeConfig {
                root: dir,
                idle_timeout: Duration::from_secs(idle_secs.max(1)),
                max_conns,
            };
            let srv = crate::pipe_serve::Server::bind(SocketAddr::new(addr, port), cfg, m)?;
            announce(&format!(
                "serving on http://{}/ ({})",
                srv.local_addr()?,
                strategy.system()
            ))?;
            srv.run()
        }
        AppCmd::Proxy {
            listen,
            upstream,
            strategy,
        } => {
            let m = mover(strategy)?;
            let p = crate::pipe_proxy::Proxy::bind(&listen, &upstream, m)?;
            announce(&format!(
                "proxying {} -> {upstream} ({})",
                p.local_addr()?,
                strategy.system()
            ))?;
            p.run()
        }
    }
}

/// One line on stdout, flushed (scripts and tests wait for it to learn the port).
fn announce(s: &str) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{s}")?;
    out.flush()?;
    Ok(())
}
