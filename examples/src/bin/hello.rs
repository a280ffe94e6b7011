//! Hello, Fido: two processes, one service, one zero-copy round trip.
//!
//! `hello` starts a broker on a thread (in a temporary directory) unless
//! `FIDO_BROKER` names a running one, re-executes itself as `hello server` (a
//! domain offering the service "greeter"), then joins as the client: it sends a
//! message built in its own arena and prints the reply, which it reads in place
//! in the server's arena. The server also writes a registry key that the
//! client watches.

#![forbid(unsafe_code)]

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context};
use fido::{Domain, JoinOptions, Message};

/// The child process: offers "greeter", answers one request, then waits for
/// the client to close (the reply lives in our arena until it is released).
fn server() -> anyhow::Result<()> {
    let d = Domain::join(JoinOptions::new("hello-server").arena_len(16 << 20))?;
    let listener = d.offer("greeter")?;
    println!("ready"); // the parent connects once it reads this line
    let ch = listener.accept_timeout(Duration::from_secs(10))?;
    // A read-only view of the client's buffer. Copy out what you keep: the
    // sender can still change its bytes.
    let req = ch.recv()?;
    let name = String::from_utf8_lossy(&req.to_vec()).into_owned(); // a counted copy
    drop(req); // releases the buffer: the client's arena gets it back
    println!("server received: {name}");
    let reply = format!("hello, {name}!");
    let mut buf = d.alloc(reply.len())?;
    buf.copy_from_slice(reply.as_bytes());
    ch.send(Message::new(buf).tag(1))?;
    d.write("/app/hello/greeted", name.as_bytes())?;
    let _ = ch.recv(); // returns Err(Closed) when the client closes
    Ok(())
}

fn main() -> anyhow::Result<()> {
    if std::env::args().nth(1).as_deref() == Some("server") {
        return server();
    }
    let dir = tempfile::tempdir()?;
    let (socket, broker) = match std::env::var_os("FIDO_BROKER").filter(|p| !p.is_empty()) {
        Some(path) => (PathBuf::from(path), None),
        None => {
            let socket = dir.path().join("broker.sock");
            let config = fido_broker::Config::new(&socket, dir.path().join("state"));
            (socket, Some(fido_broker::Embedded::start(config)?))
        }
    };
    let mut child = Command::new(std::env::current_exe()?)
        .arg("server")
        .env("FIDO_BROKER", &socket)
        .stdout(Stdio::piped())
        .spawn()?;
    let mut lines = BufReader::new(child.stdout.take().context("server stdout")?).lines();
    if !matches!(lines.next(), Some(Ok(line)) if line == "ready") {
        bail!("the server did not start: {}", child.wait()?);
    }

    let opts = JoinOptions::new("hello-client").arena_len(16 << 20);
    let d = Domain::join(opts.broker(&socket))?;
    let watch = d.watch("/app/hello")?; // every write or delete at or under it
    let ch = d.connect("greeter")?;
    let mut buf = d.alloc(5)?; // a buffer in our arena; the server maps it read-only
    buf.copy_from_slice(b"world");
    ch.send(buf)?;
    println!("client sent: world");
    let wait = Duration::from_secs(10);
    let reply = ch.recv_timeout(wait)?;
    let mut text = String::new(); // decoded as it is read in place: no copy kept
    reply.segments().for_each(|v| v.read_chunks(|c| text.push_str(&String::from_utf8_lossy(c))));
    let (tag, from) = (reply.tag(), reply.from_domain());
    println!("client received: {text} (tag {tag}, from domain {from})");
    let ev = watch.recv_timeout(wait).context("no watch event")?;
    let value = String::from_utf8_lossy(ev.value.as_deref().unwrap_or_default());
    println!("watch: {} = {value:?}", ev.path);
    let copied = d.counters().bytes_copied;
    println!("payload bytes copied by the client: {copied}");
    drop((reply, ch, watch)); // release the reply, close the channel, unwatch
    d.leave()?; // peers would see PeerGone { reason: "left" }

    let status = child.wait()?;
    for line in lines {
        println!("{}", line?); // the server's own output, after it exited
    }
    if !status.success() {
        bail!("the server failed: {status}");
    }
    if let Some(broker) = broker {
        broker.stop()?;
    }
    Ok(())
}
