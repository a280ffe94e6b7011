//! Quick throughput check of the pipe engine against the same transfer done
//! in this process with sendfile / copy_file_range / read+write, in one run.
//! A private broker runs on a thread of this process (its engine thread does
//! the moving). Not the paper's benchmark (that is `fido-bench pipe`).
//!
//!   cargo run --release -p fido-pipe --example throughput -- [MiB] [dir]

use std::io::Read;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use fido_pipe::{Client, ClientOptions};

fn drain(mut s: UnixStream) -> std::thread::JoinHandle<u64> {
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 1 << 20];
        let mut n = 0u64;
        loop {
            match s.read(&mut buf) {
                Ok(0) | Err(_) => return n,
                Ok(k) => n += k as u64,
            }
        }
    })
}

fn report(what: &str, bytes: u64, t: Duration) {
    println!(
        "{what:<44} {:>8.1} MiB/s  ({bytes} bytes in {:.3} s)",
        bytes as f64 / t.as_secs_f64() / (1 << 20) as f64,
        t.as_secs_f64()
    );
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let mib: u64 = args.get(1).map_or(Ok(256), |s| s.parse())?;
    let dir = tempfile::tempdir_in(args.get(2).map_or("/tmp", |s| s.as_str()))?;
    let len = mib << 20;
    let src_path = dir.path().join("src");
    {
        let block: Vec<u8> = (0..1u32 << 20).map(|i| ((i * 31) >> 3) as u8).collect();
        let mut f = std::fs::File::create(&src_path)?;
        for _ in 0..mib {
            std::io::Write::write_all(&mut f, &block)?;
        }
    }
    let src = std::fs::File::open(&src_path)?;
    // Warm the page cache.
    let mut sink = std::io::sink();
    std::io::copy(&mut std::fs::File::open(&src_path)?, &mut sink)?;

    let socket = dir.path().join("broker.sock");
    let mut cfg = fido_broker::Config::new(&socket, dir.path().join("state"));
    cfg.pipe.capacity = fido_broker::Capacity::Unlimited;
    let broker = fido_broker::Embedded::start(cfg)?;
    let c = Client::connect_with(ClientOptions::new("throughput").broker(&socket))?;

    for round in 0..2 {
        println!("-- round {round}: {mib} MiB from the page cache");
        // file -> socket
        let (tx, rx) = UnixStream::pair()?;
        let d = drain(rx);
        let t = Instant::now();
        let mut off = 0u64;
        while off < len {
            let mut o = off;
            off += rustix::fs::sendfile(&tx, &src, Some(&mut o), (len - off) as usize)? as u64;
        }
        drop(tx);
        let n = d.join().unwrap();
        report("file->socket  sendfile in-process", n, t.elapsed());

        let (tx, rx) = UnixStream::pair()?;
        let d = drain(rx);
        let t = Instant::now();
        let mut buf = vec![0u8; 1 << 20];
        let mut off = 0u64;
        while off < len {
            let k = rustix::io::pread(&src, &mut buf, off)?;
            let mut w = 0;
            while w < k {
                w += rustix::io::write(&tx, &buf[w..k])?;
            }
            off += k as u64;
        }
        drop(tx);
        let n = d.join().unwrap();
        report("file->socket  read/write in-process", n, t.elapsed());

        let (tx, rx) = UnixStream::pair()?;
        let d = drain(rx);
        let t = Instant::now();
        let r = c.file_to_socket(&src, &tx, 0, len)?;
        drop(tx);
        let n = d.join().unwrap();
        assert_eq!(r.moved, n);
        report("file->socket  fido pipe (broker engine)", n, t.elapsed());

        // file -> file
        let dst = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(dir.path().join("dst"))?;
        let t = Instant::now();
        let mut off = 0u64;
        while off < len {
            let (mut i, mut o) = (off, off);
            off += rustix::fs::copy_file_range(
                &src,
                Some(&mut i),
                &dst,
                Some(&mut o),
                (len - off) as usize,
            )? as u64;
        }
        report("file->file    copy_file_range in-process", len, t.elapsed());
        dst.set_len(0)?;
        let t = Instant::now();
        let r = c.file_to_file(&src, &dst, 0, len, 0)?;
        report(
            "file->file    fido pipe (broker engine)",
            r.moved,
            t.elapsed(),
        );
    }
    // The control round trip alone (no engine), for comparison.
    let n = 2000;
    let mut lat = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        c.status()?;
        lat.push(t.elapsed());
    }
    lat.sort();
    println!("broker round trip (Status):   p50 {:?} p99 {:?} ({n} ops)", lat[n / 2], lat[n * 99 / 100]);
    // Small transfers: per-operation latency (what a file server pays per response).
    let (tx, rx) = UnixStream::pair()?;
    let d = drain(rx);
    let p = c.create(&src, &tx)?;
    let n = 2000;
    let mut lat = Vec::with_capacity(n);
    for i in 0..n {
        let t = Instant::now();
        p.file_to_socket((i as u64 * 4096) % len, 4096)?;
        lat.push(t.elapsed());
    }
    lat.sort();
    println!(
        "4 KiB file->socket on a pipe: p50 {:?} p99 {:?} ({n} ops)",
        lat[n / 2],
        lat[n * 99 / 100]
    );
    let mut lat = Vec::with_capacity(n);
    for i in 0..n {
        let t = Instant::now();
        c.file_to_socket(&src, &tx, (i as u64 * 4096) % len, 4096)?;
        lat.push(t.elapsed());
    }
    lat.sort();
    println!(
        "4 KiB file->socket one-shot:  p50 {:?} p99 {:?} ({n} ops)",
        lat[n / 2],
        lat[n * 99 / 100]
    );
    drop(p);
    drop(tx);
    d.join().unwrap();
    drop(c);
    broker.stop()?;
    Ok(())
}
