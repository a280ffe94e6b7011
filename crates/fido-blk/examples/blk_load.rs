//! A load generator for a running block service, through the native API:
//!
//!   cargo run --release -p fido-blk --example blk_load -- NAME [read|write] \
//!       [--bs 4096] [--qd 32] [--secs 3] [--clients 1] [--seq]
//!
//! Each client is its own domain with one connection, keeping `qd` requests
//! in flight (random block-aligned offsets unless --seq). Writes send buffers
//! allocated once in the client's arena (zero copies); reads drop the view
//! without copying. Prints IOPS, MB/s and the bytes each side copied.

use std::time::{Duration, Instant};

use fido::{Domain, JoinOptions};
use fido_blk::BlkClient;

struct Args {
    name: String,
    write: bool,
    bs: u32,
    qd: u64,
    secs: f64,
    clients: usize,
    seq: bool,
}

fn parse() -> Args {
    let mut a = Args { name: String::new(), write: false, bs: 4096, qd: 32, secs: 3.0, clients: 1, seq: false };
    let mut it = std::env::args().skip(1);
    while let Some(x) = it.next() {
        let mut val = || it.next().expect("a value after the option");
        match x.as_str() {
            "read" => a.write = false,
            "write" => a.write = true,
            "--bs" => a.bs = val().parse().expect("--bs BYTES"),
            "--qd" => a.qd = val().parse().expect("--qd N"),
            "--secs" => a.secs = val().parse().expect("--secs S"),
            "--clients" => a.clients = val().parse().expect("--clients N"),
            "--seq" => a.seq = true,
            _ if a.name.is_empty() => a.name = x,
            _ => panic!("unknown argument {x:?}"),
        }
    }
    assert!(!a.name.is_empty(), "usage: blk_load NAME [read|write] [--bs B] [--qd N] [--secs S] [--clients N] [--seq]");
    a
}

fn run_client(a: &Args, k: usize) -> (u64, u64) {
    let d = Domain::join(JoinOptions::new(format!("blk-load-{k}")).arena_len(1 << 30).ring_entries(256)).unwrap();
    let c = BlkClient::connect(&d, &a.name).unwrap();
    let blocks = c.info().size / u64::from(a.bs);
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15 ^ (k as u64 + 1);
    let mut seq = (k as u64 * blocks / a.clients as u64) % blocks;
    let mut next_off = move || {
        if a.seq {
            seq = (seq + 1) % blocks;
            seq * u64::from(a.bs)
        } else {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % blocks) * u64::from(a.bs)
        }
    };
    let submit = |id: u64, off: u64| {
        if a.write {
            let buf = c.alloc(a.bs as usize).unwrap();
            c.submit_write(id, off, vec![buf], false).unwrap();
        } else {
            c.submit_read(id, off, a.bs).unwrap();
        }
    };
    for id in 0..a.qd {
        submit(id, next_off());
    }
    let end = Instant::now() + Duration::from_secs_f64(a.secs);
    let mut done = 0u64;
    let mut id = a.qd;
    while Instant::now() < end {
        let r = c.complete(Duration::from_secs(30)).unwrap();
        drop(r.result.unwrap());
        done += 1;
        submit(id, next_off());
        id += 1;
    }
    for _ in 0..a.qd {
        c.complete(Duration::from_secs(30)).unwrap().result.unwrap();
    }
    (done, d.counters().bytes_copied)
}

fn main() {
    let a = parse();
    let t0 = Instant::now();
    let results: Vec<(u64, u64)> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..a.clients).map(|k| { let a = &a; s.spawn(move || run_client(a, k)) }).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let secs = t0.elapsed().as_secs_f64().min(a.secs.max(1e-9));
    let ops: u64 = results.iter().map(|r| r.0).sum();
    let copied: u64 = results.iter().map(|r| r.1).sum();
    println!(
        "{} {} bs={} qd={} clients={}: {:.0} IOPS, {:.1} MB/s, client bytes_copied={}",
        a.name,
        if a.write { "write" } else { "read" },
        a.bs,
        a.qd,
        a.clients,
        ops as f64 / secs,
        ops as f64 * f64::from(a.bs) / secs / 1e6,
        copied
    );
}
