//! `fido status`: joins as a short-lived domain and prints the broker's view.

use std::path::PathBuf;

use anyhow::Context as _;
use fido::{Domain, JoinOptions, Status};
use serde_json::{json, Value};

use fido_demo::pipeline::counters_json;
use fido_demo::text::table;

pub fn run(json_out: bool, socket: Option<PathBuf>) -> anyhow::Result<()> {
    let path = socket.unwrap_or_else(fido::default_broker_path);
    let opts = JoinOptions::new("fido-status")
        .broker(&path)
        .arena_len(1 << 20)
        .ring_entries(2);
    let d = Domain::join(opts).with_context(|| format!("no broker at {}", path.display()))?;
    let st = d.status().context("asking the broker for its status")?;
    let net = net_stats(&d);
    let me = d.id();
    // Leave explicitly: the broker records a clean departure at once.
    let _ = d.leave();
    if json_out {
        let mut v = to_json(&st);
        v["net"] = Value::Array(net);
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        print_text(&st, &path, me);
        print_net(&net);
    }
    Ok(())
}

pub fn to_json(st: &Status) -> Value {
    json!({
        "broker_pid": st.broker_pid,
        "domains": st.domains.iter().map(|d| json!({
            "domain": d.domain,
            "name": d.name,
            "pid": d.pid,
            "uid": d.uid,
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

fn print_text(st: &Status, path: &std::path::Path, me: u64) {
    println!("broker: pid {} on {}", st.broker_pid, path.display());
    println!(
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
                if d.domain == me {
                    format!("{} (this query)", d.name)
                } else {
                    d.name.clone()
                },
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
            ]
        })
        .collect();
    print!(
        "{}",
        table(
            &[
                "id",
                "name",
                "pid",
                "slot",
                "arena",
                "msgs sent/recv",
                "bytes sent/recv",
                "copied",
                "doorbells rung/suppressed"
            ],
            &rows
        )
    );
    println!("\nservices ({}):", st.services.len());
    let rows: Vec<Vec<String>> = st
        .services
        .iter()
        .map(|(s, d)| vec![s.clone(), d.to_string()])
        .collect();
    print!("{}", table(&["service", "domain"], &rows));
    println!("\nconnections ({}):", st.connections.len());
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
    print!("{}", table(&["conn", "service", "client", "server"], &rows));
    if let Some(e) = &st.pipe_engine {
        let cap = match e.capacity {
            Some(c) => format!(
                "{}/s{}",
                human_bytes(c),
                if e.calibrated { " (calibrated)" } else { "" }
            ),
            None => "unlimited".into(),
        };
        println!(
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
        print!(
            "{}",
            table(
                &[
                    "domain",
                    "name",
                    "weight",
                    "throughput",
                    "moved",
                    "credits (B)",
                    "pipes",
                    "running"
                ],
                &rows
            )
        );
    }
}

/// MMNet statistics each process under `fido run` publishes at
/// `/net/stats/<domain>` (JSON; see docs/NET.md), oldest domain first.
fn net_stats(d: &Domain) -> Vec<Value> {
    let mut ids: Vec<u64> = d
        .list("/net/stats")
        .unwrap_or_default()
        .iter()
        .filter_map(|s| s.parse().ok())
        .collect();
    ids.sort_unstable();
    ids.iter()
        .filter_map(|id| {
            let raw = d.read(&format!("/net/stats/{id}")).ok()??;
            let mut v: Value = serde_json::from_slice(&raw).ok()?;
            v["domain"] = json!(id);
            Some(v)
        })
        .collect()
}

fn print_net(net: &[Value]) {
    println!("\nnet: processes under `fido run` ({}):", net.len());
    let rows: Vec<Vec<String>> = net
        .iter()
        .map(|v| {
            vec![
                v["domain"].to_string(),
                v["name"].as_str().unwrap_or("?").to_string(),
                v["pid"].to_string(),
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
    print!(
        "{}",
        table(
            &[
                "domain",
                "name",
                "pid",
                "accelerated",
                "plain (local)",
                "bytes sent/recv",
                "doorbells"
            ],
            &rows
        )
    );
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
    println!("\naccelerated connections open ({}):", open.len());
    print!(
        "{}",
        table(
            &[
                "pid",
                "side",
                "local",
                "peer",
                "sent",
                "received",
                "doorbells",
                "arming"
            ],
            &open
        )
    );
}
