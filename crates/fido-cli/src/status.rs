//! `fido status`: asks the broker for its view without joining (no PGVAS
//! slot, no arena: it works however full the broker is) and prints it.
//!
//! The broker shows each asker what its uid may see (root and the broker's
//! uid: everything); the answer comes in pages, all of which are fetched.
//! Output goes out in one write at the end; a reader that goes away early
//! (`fido status | head`) ends the command quietly.

use std::fmt::Write as _;
use std::io::Write as _;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context as _};
use fido::Status;
use fido_proto::{BrokerMsg, ClientMsg, RemoteError, Reply, Request};
use rustix::event::{poll, PollFd, PollFlags, Timespec};
use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
use serde_json::{json, Value};

use fido_demo::pipeline::counters_json;
use fido_demo::text::table;

/// How long one answer may take before the broker counts as unresponsive.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(10);

pub fn run(json_out: bool, socket: Option<PathBuf>) -> anyhow::Result<()> {
    let path = socket.unwrap_or_else(fido::default_broker_path);
    let mut broker = Observer::connect(&path)?;
    let st = Status::collect(|req| match broker.ask(req)? {
        Reply::Status(s) => Ok(s),
        other => Err(anyhow!("unexpected answer to Status: {other:?}")),
    })
    .with_context(|| format!("asking the broker at {} for its status", path.display()))?;
    let live: Vec<u64> = st.domains.iter().map(|d| d.domain).collect();
    let net = net_stats(&mut broker, &live);
    let mut out = String::new();
    if json_out {
        let mut v = to_json(&st);
        v["net"] = Value::Array(net);
        out = serde_json::to_string_pretty(&v)? + "\n";
    } else {
        print_text(&mut out, &st, &path);
        print_net(&mut out, &net);
    }
    write_stdout(&out)
}

/// Writes `text` to standard output; a reader that went away (`EPIPE`) is
/// not an error: the command ends quietly, as `head` expects.
pub fn write_stdout(text: &str) -> anyhow::Result<()> {
    let mut stdout = std::io::stdout().lock();
    match stdout
        .write_all(text.as_bytes())
        .and_then(|()| stdout.flush())
    {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        r => r.context("writing to standard output"),
    }
}

/// A connection to the broker that never joins: it may ask only what looks
/// (`Status`, `StatusPage`, `Read`, `List`), as far as its uid may see.
struct Observer {
    sock: OwnedFd,
    next_id: u64,
    buf: Vec<u8>,
}

impl Observer {
    fn connect(path: &Path) -> anyhow::Result<Observer> {
        let sock = rustix::net::socket_with(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC,
            None,
        )
        .context("socket")?;
        let addr = SocketAddrUnix::new(path)
            .with_context(|| format!("broker address {}", path.display()))?;
        rustix::net::connect(&sock, &addr).map_err(|e| {
            anyhow!(
                "no broker at {}: {}",
                path.display(),
                std::io::Error::from(e)
            )
        })?;
        Ok(Observer {
            sock,
            next_id: 1,
            buf: vec![0; fido_proto::MAX_MESSAGE],
        })
    }

    /// Sends `body` and waits for its answer; the broker's refusal (`Denied`,
    /// `Quota`, ...) comes back as the error, with its code and message.
    fn ask(&mut self, body: Request) -> anyhow::Result<Reply> {
        let id = self.next_id;
        self.next_id += 1;
        let frame = fido_proto::encode(&ClientMsg::Request { id, body })?;
        fido_proto::wire::send_blocking(self.sock.as_fd(), &frame, &[]).map_err(|e| {
            anyhow!(
                "the broker closed the connection: {}",
                std::io::Error::from(e)
            )
        })?;
        let deadline = Instant::now() + ANSWER_TIMEOUT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                bail!("the broker did not answer within {ANSWER_TIMEOUT:?}");
            }
            let ts = Timespec {
                tv_sec: left.as_secs() as i64,
                tv_nsec: left.subsec_nanos() as i64,
            };
            let mut fds = [PollFd::new(&self.sock, PollFlags::IN)];
            match poll(&mut fds, Some(&ts)) {
                Ok(0) | Err(rustix::io::Errno::INTR) => continue,
                Ok(_) => {}
                Err(e) => return Err(std::io::Error::from(e).into()),
            }
            let (len, truncated) = match fido_proto::wire::recv(self.sock.as_fd(), &mut self.buf)
                .map_err(std::io::Error::from)?
            {
                fido_proto::wire::Recv::Eof => bail!("the broker closed the connection"),
                fido_proto::wire::Recv::WouldBlock => continue,
                fido_proto::wire::Recv::Msg { len, truncated, .. } => (len, truncated),
            };
            if truncated {
                bail!("the broker's answer was truncated");
            }
            match fido_proto::decode::<BrokerMsg>(&self.buf[..len])? {
                BrokerMsg::Reply { id: got, body } if got == id => {
                    return body.map_err(|e: RemoteError| anyhow!(e));
                }
                // Events are for domains; an observer has none to get.
                _ => continue,
            }
        }
    }
}

pub fn to_json(st: &Status) -> Value {
    json!({
        "broker_pid": st.broker_pid,
        "domains": st.domains.iter().map(|d| json!({
            "domain": d.domain,
            "name": d.name,
            "pid": d.pid,
            "uid": d.uid,
            "label": d.label,
            "slot": d.slot,
            "arena_len": d.arena_len,
            "counters": counters_json(&d.counters),
        })).collect::<Vec<_>>(),
        "services": st.services.iter().map(|(s, d)| json!({"service": s, "domain": d})).collect::<Vec<_>>(),
        "connections": st.connections.iter().map(|c| json!({
            "conn": c.conn, "service": c.service, "client": c.client, "server": c.server,
        })).collect::<Vec<_>>(),
        "pipe_engine": st.pipe_engine.as_ref().map(|e| json!({
            "capacity_bytes_per_s": e.capacity, "calibrated": e.calibrated,
            "work_conserving": e.work_conserving, "lanes": e.lanes,
        })),
        "pipes": st.pipes.iter().map(|p| json!({
            "domain": p.domain, "weight": p.weight, "credits": p.credits,
            "bytes_per_s": p.bytes_per_s, "bytes_total": p.bytes_total,
            "pipes": p.pipes, "running": p.running,
        })).collect::<Vec<_>>(),
    })
}

fn human_bytes(b: u64) -> String {
    const U: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut i = 0;
    while v >= 1024.0 && i < U.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", U[i])
    }
}

fn print_text(out: &mut String, st: &Status, path: &std::path::Path) {
    let _ = writeln!(out, "broker: pid {} on {}", st.broker_pid, path.display());
    let _ = writeln!(
        out,
        "\ndomains ({}; counters are what each domain last published):",
        st.domains.len()
    );
    let rows: Vec<Vec<String>> = st
        .domains
        .iter()
        .map(|d| {
            let c = &d.counters;
            vec![
                d.domain.to_string(),
                d.name.clone(),
                d.pid.to_string(),
                d.slot.to_string(),
                human_bytes(d.arena_len),
                format!("{}/{}", c.messages_sent, c.messages_received),
                format!(
                    "{}/{}",
                    human_bytes(c.bytes_sent),
                    human_bytes(c.bytes_received)
                ),
                human_bytes(c.bytes_copied),
                format!("{}/{}", c.doorbells_rung, c.doorbells_suppressed),
                d.uid.to_string(),
                d.label.clone().unwrap_or_else(|| "-".into()),
            ]
        })
        .collect();
    out.push_str(&table(
        &[
            "id",
            "name",
            "pid",
            "slot",
            "arena",
            "msgs sent/recv",
            "bytes sent/recv",
            "copied",
            "doorbells rung/suppressed",
            "uid",
            "label",
        ],
        &rows,
    ));
    let _ = writeln!(out, "\nservices ({}):", st.services.len());
    let rows: Vec<Vec<String>> = st
        .services
        .iter()
        .map(|(s, d)| vec![s.clone(), d.to_string()])
        .collect();
    out.push_str(&table(&["service", "domain"], &rows));
    let _ = writeln!(out, "\nconnections ({}):", st.connections.len());
    let rows: Vec<Vec<String>> = st
        .connections
        .iter()
        .map(|c| {
            vec![
                c.conn.to_string(),
                c.service.clone(),
                c.client.to_string(),
                c.server.to_string(),
            ]
        })
        .collect();
    out.push_str(&table(&["conn", "service", "client", "server"], &rows));
    if let Some(e) = &st.pipe_engine {
        let cap = match e.capacity {
            Some(c) => format!(
                "{}/s{}",
                human_bytes(c),
                if e.calibrated { " (calibrated)" } else { "" }
            ),
            None => "unlimited".into(),
        };
        let _ = writeln!(
            out,
            "\npipe engine: capacity {cap}, {}, {} lanes; domains with pipes ({}):",
            if e.work_conserving {
                "work-conserving"
            } else {
                "strict shares"
            },
            e.lanes,
            st.pipes.len()
        );
        let rows: Vec<Vec<String>> = st
            .pipes
            .iter()
            .map(|p| {
                let name = st
                    .domains
                    .iter()
                    .find(|d| d.domain == p.domain)
                    .map_or("", |d| d.name.as_str());
                vec![
                    p.domain.to_string(),
                    name.to_string(),
                    p.weight.to_string(),
                    format!("{}/s", human_bytes(p.bytes_per_s)),
                    human_bytes(p.bytes_total),
                    p.credits.to_string(),
                    p.pipes.to_string(),
                    p.running.to_string(),
                ]
            })
            .collect();
        out.push_str(&table(
            &[
                "domain",
                "name",
                "weight",
                "throughput",
                "moved",
                "credits (B)",
                "pipes",
                "running",
            ],
            &rows,
        ));
    }
}

/// MMNet statistics each process under `fido run` publishes at
/// `/net/stats/<domain>` (JSON; see docs/NET.md), oldest domain first.
/// A process whose domain is gone (`live` lists those the broker knows)
/// exited — maybe killed, or without closing its sockets: its connections
/// died with it, so none of them is listed as open (`"alive": false`).
fn net_stats(d: &mut Observer, live: &[u64]) -> Vec<Value> {
    let listed = fido_proto::ListCursor::walk("/net/stats", |req| match d.ask(req)? {
        Reply::KeysPage { keys, next } => Ok((keys, next)),
        other => Err(anyhow!("unexpected answer to ListPage: {other:?}")),
    });
    let mut ids: Vec<u64> = listed
        .unwrap_or_default()
        .iter()
        .filter_map(|s| s.parse().ok())
        .collect();
    ids.sort_unstable();
    ids.iter()
        .filter_map(|id| {
            let raw = match d.ask(Request::Read {
                path: format!("/net/stats/{id}"),
            }) {
                Ok(Reply::Value(v)) => v?,
                _ => return None,
            };
            let mut v: Value = serde_json::from_slice(&raw).ok()?;
            v["domain"] = json!(id);
            let alive = live.contains(id);
            v["alive"] = json!(alive);
            if !alive {
                v["open"] = json!([]);
            }
            Some(v)
        })
        .collect()
}

fn print_net(out: &mut String, net: &[Value]) {
    let _ = writeln!(out, "\nnet: processes under `fido run` ({}):", net.len());
    let rows: Vec<Vec<String>> = net
        .iter()
        .map(|v| {
            vec![
                v["domain"].to_string(),
                v["name"].as_str().unwrap_or("?").to_string(),
                if v["alive"] == false {
                    format!("{} (exited)", v["pid"])
                } else {
                    v["pid"].to_string()
                },
                v["accelerated"].to_string(),
                v["plain_local"].to_string(),
                format!(
                    "{}/{}",
                    human_bytes(v["bytes_sent"].as_u64().unwrap_or(0)),
                    human_bytes(v["bytes_received"].as_u64().unwrap_or(0))
                ),
                v["doorbells"].as_u64().unwrap_or(0).to_string(),
            ]
        })
        .collect();
    out.push_str(&table(
        &[
            "domain",
            "name",
            "pid",
            "accelerated",
            "plain (local)",
            "bytes sent/recv",
            "doorbells",
        ],
        &rows,
    ));
    let open: Vec<Vec<String>> = net
        .iter()
        .flat_map(|v| {
            let pid = v["pid"].to_string();
            v["open"]
                .as_array()
                .cloned()
                .unwrap_or_default()
                .into_iter()
                .map(move |c| {
                    vec![
                        pid.clone(),
                        c["side"].as_str().unwrap_or("?").to_string(),
                        c["local"].as_str().unwrap_or("?").to_string(),
                        c["peer"].as_str().unwrap_or("?").to_string(),
                        human_bytes(c["bytes_sent"].as_u64().unwrap_or(0)),
                        human_bytes(c["bytes_received"].as_u64().unwrap_or(0)),
                        c["doorbells"].as_u64().unwrap_or(0).to_string(),
                        c["arming"].as_str().unwrap_or("?").to_string(),
                    ]
                })
        })
        .collect();
    let _ = writeln!(out, "\naccelerated connections open ({}):", open.len());
    out.push_str(&table(
        &[
            "pid",
            "side",
            "local",
            "peer",
            "sent",
            "received",
            "doorbells",
            "arming",
        ],
        &open,
    ));
}
