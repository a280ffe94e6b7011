//! The case study: a file server whose reads are views of its cache.
//!
//! cargo run --release -p fido-rpc --example file_server -- DIR FILE [CHUNK]
//!
//! Starts a private broker, serves DIR from a child process (this program
//! re-executed with `--serve DIR`), reads FILE through RPC in CHUNK-byte
//! pieces (default 64 KiB), checks every byte against the file on disk, and
//! prints the throughput and the bytes either side copied (0 on the RPC
//! path: the server copies the file into its cache once, from disk).

use fido::{Domain, JoinOptions};
use fido_examples::services::files::{FileServer, FilesClient, FilesServer};
use fido_rpc::{Server, ServerOptions};
use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Instant;

/// `FIDO_WAIT=block|poll|adaptive` (default block): how both sides wait.
fn wait() -> fido::WaitStrategy {
    match std::env::var("FIDO_WAIT").as_deref() {
        Ok("poll") => fido::WaitStrategy::BusyPoll,
        Ok("adaptive") => fido::WaitStrategy::Adaptive { spin: std::time::Duration::from_micros(50) },
        _ => fido::WaitStrategy::Block,
    }
}

fn serve(dir: &str) -> Result<(), Box<dyn std::error::Error>> {
    let d = Domain::join(JoinOptions::new("file-server").arena_len(1 << 30))?;
    let fs = FileServer::new(d.arena(), Some(Path::new(dir)));
    let _h = Server::spawn(&d, "files", FilesServer(fs), ServerOptions { workers: 1, wait: Some(wait()) })?;
    println!("ready");
    let _ = std::io::stdin().read(&mut [0u8; 1]);
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("--serve") {
        return serve(&args[2]);
    }
    let (Some(dir), Some(file)) = (args.get(1), args.get(2)) else {
        eprintln!("usage: file_server DIR FILE [CHUNK]");
        std::process::exit(2);
    };
    let chunk: u64 = args.get(3).map(|s| s.parse()).transpose()?.unwrap_or(64 << 10);
    let want = std::fs::read(Path::new(dir).join(file))?;

    let tmp = tempfile::tempdir()?;
    let sock = tmp.path().join("broker.sock");
    let broker = fido_broker::Embedded::start(fido_broker::Config::new(&sock, tmp.path().join("state")))?;
    let mut child = Command::new(std::env::current_exe()?)
        .args(["--serve", dir])
        .env("FIDO_BROKER", &sock)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()?;
    child.stdout.take().expect("piped").read_exact(&mut [0u8; 6])?;

    let d = Domain::join(JoinOptions::new("file-client").broker(&sock).arena_len(64 << 20))?;
    let c = FilesClient::connect(&d, "files")?;
    c.0.set_wait(wait());
    let path = |c: &FilesClient| -> Result<_, fido_rpc::RpcError> {
        let mut f = c.frame()?;
        let p = f.str(file)?;
        Ok((f, p))
    };
    let (f, p) = path(&c)?;
    let size = *c.stat(f, p)?.get();
    assert_eq!(size, want.len() as u64);
    for pass in ["cold", "warm"] {
        let t = Instant::now();
        let mut off = 0u64;
        while off < size {
            let (f, p) = path(&c)?;
            let r = c.read(f, p, off, chunk)?;
            let bytes = r.slice(*r.get())?; // the server's cache, in place
            assert_eq!(bytes, &want[off as usize..off as usize + bytes.len()]);
            off += bytes.len() as u64;
        }
        let s = t.elapsed().as_secs_f64();
        println!("{pass}: {size} bytes in {:.3} ms ({:.2} GB/s, chunk {chunk}), every byte checked", s * 1e3, size as f64 / s / 1e9);
    }
    println!("bytes copied by the client: {}", d.counters().bytes_copied);
    drop(child.stdin.take());
    let _ = child.wait();
    broker.stop()?;
    Ok(())
}
