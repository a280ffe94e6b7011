//! The real NBD clients from Debian against the server with a memory export:
//! qemu-img, qemu-io, nbdinfo, nbdcopy, fio. Each skips when its tool is
//! missing.

mod common;

use std::process::Command;

use common::*;
use fido_blk_nbd::MemoryOptions;

const MIB: u64 = 1 << 20;

#[test]
fn qemu_img_info_and_convert_round_trip() {
    if !have("qemu-img") {
        return;
    }
    let s = TestServer::start(MemoryOptions::new(64 * MIB));
    let info = stdout(Command::new("qemu-img").args(["info", "--output=json", &s.uri("mem")]));
    assert!(info.contains("\"virtual-size\": 67108864"), "{info}");

    let src = s.dir.path().join("src.raw");
    let back = s.dir.path().join("back.raw");
    pattern_file(&src, 48 * MIB as usize, 7);
    run(Command::new("qemu-img").args(["convert", "-n", "-f", "raw", "-O", "raw"]).arg(&src).arg(s.uri("mem")));
    run(Command::new("qemu-img").args(["convert", "-f", "raw", "-O", "raw"]).arg(s.uri("mem")).arg(&back));
    let a = std::fs::read(&src).unwrap();
    let b = std::fs::read(&back).unwrap();
    assert_eq!(b.len(), 64 * MIB as usize);
    assert!(a == b[..a.len()], "image read back differs");
    assert!(b[a.len()..].iter().all(|&x| x == 0));
    // The server saw the same bytes.
    assert!(s.export().read_back(0, a.len()) == a);
    run(Command::new("qemu-img").args(["compare", "-f", "raw", "-F", "raw"]).arg(&back).arg(s.uri("mem")));
}

#[test]
fn qemu_io_write_read_flush_discard_zero() {
    if !have("qemu-io") {
        return;
    }
    let s = TestServer::start(MemoryOptions::new(16 * MIB));
    let out = stdout(Command::new("qemu-io").args([
        "-f",
        "raw",
        "-c",
        "write -P 0xab 0 1M",
        "-c",
        "read -P 0xab 0 1M",
        "-c",
        "write -P 0xcd -f 4M 3M",
        "-c",
        "read -P 0xcd 4M 3M",
        "-c",
        "flush",
        "-c",
        "discard 0 512k",
        "-c",
        "write -z 4M 1M",
        "-c",
        "read -P 0 4M 1M",
        "-c",
        "read -P 0xcd 5M 2M",
        "-c",
        "read -P 0xab 512k 512k",
        &s.uri("mem"),
    ]));
    assert!(!out.contains("Pattern verification failed"), "{out}");
    assert!(!out.to_lowercase().contains("error"), "{out}");
    assert!(s.export().read_back(512 << 10, 512 << 10).iter().all(|&b| b == 0xab));
    assert!(s.export().read_back(4 * MIB, MIB as usize).iter().all(|&b| b == 0));
}

#[test]
fn qemu_io_over_tcp() {
    if !have("qemu-io") {
        return;
    }
    let export = fido_blk_nbd::MemoryExport::new(MemoryOptions::new(4 * MIB)).unwrap();
    let server = fido_blk_nbd::NbdServer::new(export, fido_blk_nbd::ServerConfig::new("mem")).unwrap();
    let listener = fido_blk_nbd::Listener::bind_tcp("127.0.0.1:0").unwrap();
    let addr = listener.describe();
    let addr = addr.strip_prefix("tcp:").expect("a TCP listener").to_string();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let t = {
        let (server, stop) = (server.clone(), stop.clone());
        std::thread::spawn(move || server.serve(&listener, &stop).unwrap())
    };
    let out = stdout(Command::new("qemu-io").args([
        "-f",
        "raw",
        "-c",
        "write -P 0x3c 512k 1M",
        "-c",
        "read -P 0x3c 512k 1M",
        &format!("nbd://{addr}/mem"),
    ]));
    assert!(!out.contains("verification failed") && !out.to_lowercase().contains("error"), "{out}");
    assert!(server.export().read_back(512 << 10, 1 << 20).iter().all(|&b| b == 0x3c));
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    t.join().unwrap();
}

#[test]
fn nbdinfo_list_and_map() {
    if !have("nbdinfo") || !have("qemu-io") {
        return;
    }
    let s = TestServer::start(MemoryOptions::new(8 * MIB));
    let list = stdout(Command::new("nbdinfo").args(["--list", "--json"]).arg(format!(
        "nbd+unix://?socket={}",
        s.socket.display()
    )));
    assert!(list.contains("\"export-name\": \"mem\""), "{list}");
    assert!(list.contains("base:allocation"), "{list}");
    assert!(list.contains("\"export-size\": 8388608"), "{list}");

    // Data at [1M, 2M), the rest never written: holes.
    run(Command::new("qemu-io").args(["-f", "raw", "-c", "write -P 0x11 1M 1M", &s.uri("mem")]));
    let map = stdout(Command::new("nbdinfo").args(["--map"]).arg(s.uri("mem")));
    let lines: Vec<Vec<&str>> = map.lines().map(|l| l.split_whitespace().collect()).collect();
    assert_eq!(lines.len(), 3, "{map}");
    assert_eq!(lines[0][..3], ["0", "1048576", "3"], "{map}");
    assert_eq!(lines[1][..3], ["1048576", "1048576", "0"], "{map}");
    assert_eq!(lines[2][..3], ["2097152", "6291456", "3"], "{map}");
}

#[test]
fn nbdcopy_both_ways() {
    if !have("nbdcopy") {
        return;
    }
    let s = TestServer::start(MemoryOptions::new(32 * MIB));
    let src = s.dir.path().join("src.raw");
    let back = s.dir.path().join("back.raw");
    pattern_file(&src, 32 * MIB as usize, 99);
    run(Command::new("nbdcopy").arg(&src).arg(s.uri("mem")));
    run(Command::new("nbdcopy").arg(s.uri("mem")).arg(&back));
    assert!(std::fs::read(&src).unwrap() == std::fs::read(&back).unwrap(), "nbdcopy round trip differs");
    // Multi-conn: nbdcopy opens several connections when the server allows it.
    run(Command::new("nbdcopy").args(["--connections=4", "--requests=16"]).arg(s.uri("mem")).arg(&back));
    assert!(std::fs::read(&src).unwrap() == std::fs::read(&back).unwrap());
}

#[test]
fn fio_randrw_verify() {
    if !have("fio") {
        return;
    }
    let s = TestServer::start(MemoryOptions::new(64 * MIB));
    let out = stdout(Command::new("fio").args([
        "--name=verify",
        "--ioengine=nbd",
        &format!("--uri={}", s.uri("mem")),
        "--rw=randrw",
        "--bs=4k,64k",
        "--iodepth=16",
        "--size=32M",
        "--verify=crc32c",
        "--verify_fatal=1",
        // No verify state file left in the working directory.
        "--verify_state_save=0",
        "--do_verify=1",
        "--output-format=json",
    ]));
    assert!(out.contains("\"error\" : 0"), "{out}");
}
