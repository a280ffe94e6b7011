//! `fido pipe ...`: the applications built on the pipe engine.
//!
//! * `fido pipe serve DIR --port P`: static files over HTTP/1.1, bodies moved
//!   file→socket by the engine ([`fido_pipe_apps::serve`]).
//! * `fido pipe proxy LISTEN UPSTREAM`: a TCP forwarder, both directions moved
//!   socket→socket by the engine ([`fido_pipe_apps::proxy`]).
//!
//! `--strategy sendfile|readwrite` runs the same program with the bytes moved in
//! this process instead (what `fido-bench pipe` compares against).

use std::io::Write as _;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use clap::builder::{PossibleValue, PossibleValuesParser, TypedValueParser as _};
use clap::Subcommand;
use fido_pipe_apps::{engine, proxy, serve, Strategy};

/// `--strategy NAME`, with each strategy's description in the help.
fn strategy_arg() -> impl clap::builder::TypedValueParser<Value = Strategy> {
    PossibleValuesParser::new(
        Strategy::ALL.map(|s| PossibleValue::new(s.name()).help(s.describe())),
    )
    .map(|name| name.parse::<Strategy>().expect("one of the possible values"))
}

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
        #[arg(long, value_parser = strategy_arg(), default_value = "fido")]
        strategy: Strategy,
        /// Close a connection idle (or not reading) for this many seconds.
        #[arg(long, default_value_t = 60)]
        idle_secs: u64,
        /// A request head (and body) must arrive within this many seconds, however it trickles in (else 408).
        #[arg(long, default_value_t = 10)]
        head_secs: u64,
        /// Connections served at once (more are answered 503).
        #[arg(long, default_value_t = 1024)]
        max_conns: usize,
        /// Connections one peer may hold: a local uid (whoever owns the client socket), or a remote address (more are answered 503).
        #[arg(long, default_value_t = 64)]
        max_conns_per_peer: usize,
        /// Refuse every symlink under DIR (by default symlinks that stay beneath DIR are followed; absolute ones and those leading out never).
        #[arg(long)]
        no_symlinks: bool,
    },
    /// Forward TCP connections from LISTEN to UPSTREAM; both directions go socket→socket through the broker's pipe engine.
    Proxy {
        /// Address to listen on, e.g. 127.0.0.1:8080 (port 0: any; printed).
        listen: String,
        /// Where to connect, e.g. 127.0.0.1:80.
        upstream: String,
        /// Who moves the bytes.
        #[arg(long, value_parser = strategy_arg(), default_value = "fido")]
        strategy: Strategy,
        /// Client connections forwarded at once (more are closed at once).
        #[arg(long, default_value_t = 1024)]
        max_conns: usize,
        /// Client connections one peer may hold: a local uid, or a remote address (more are closed at once).
        #[arg(long, default_value_t = 64)]
        max_conns_per_peer: usize,
    },
}

pub fn run(cmd: AppCmd) -> anyhow::Result<()> {
    match cmd {
        AppCmd::Serve {
            dir,
            port,
            addr,
            strategy,
            idle_secs,
            head_secs,
            max_conns,
            max_conns_per_peer,
            no_symlinks,
        } => {
            let m = match strategy {
                Strategy::Fido => {
                    engine::mover_with_stall(Duration::from_secs(idle_secs.max(1)))?
                }
                s => s.mover()?,
            };
            let cfg = serve::ServeConfig {
                idle_timeout: Duration::from_secs(idle_secs.max(1)),
                head_timeout: Duration::from_secs(head_secs.max(1)),
                max_conns,
                max_conns_per_peer,
                follow_symlinks: !no_symlinks,
                ..serve::ServeConfig::new(dir)
            };
            let srv = serve::Server::bind(SocketAddr::new(addr, port), cfg, m)?;
            announce(&format!(
                "serving on http://{}/ ({})",
                srv.local_addr()?,
                strategy.system()
            ))?;
            Ok(srv.run()?)
        }
        AppCmd::Proxy {
            listen,
            upstream,
            strategy,
            max_conns,
            max_conns_per_peer,
        } => {
            let m = strategy.mover()?;
            let p = proxy::Proxy::bind(&listen, &upstream, m)?
                .with_limits(max_conns, max_conns_per_peer);
            announce(&format!(
                "proxying {} -> {upstream} ({})",
                p.local_addr()?,
                strategy.system()
            ))?;
            Ok(p.run()?)
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
