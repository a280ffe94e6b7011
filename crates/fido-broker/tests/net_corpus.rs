//! Replays the committed corpus of the `net_request` fuzz target
//! (fuzz/corpus/net_request/) through the same check (fuzz/src/net_request.rs)
//! on the stable toolchain, so every CI run re-checks every kept input.
//!
//! `cargo test -p fido-broker --test net_corpus -- --ignored regenerate_seeds`
//! rewrites the hand-written seeds (`seed-*`).

use std::path::{Path, PathBuf};

use fido_proto::{ClientMsg, Request};

#[path = "../../../fuzz/src/net_request.rs"]
mod net_request;

fn corpus() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/net_request")
}

#[test]
fn corpus_inputs_hold_the_property() {
    let mut files: Vec<PathBuf> = std::fs::read_dir(corpus())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    assert!(!files.is_empty(), "empty corpus");
    let mut accepted = 0;
    for f in &files {
        let data = std::fs::read(f).unwrap();
        let ok = std::panic::catch_unwind(|| net_request::check(&data))
            .unwrap_or_else(|_| panic!("corpus input {} violates the property", f.display()));
        accepted += ok as usize;
    }
    // The seeds include inputs of every kind that are accepted.
    assert!(accepted >= 6, "{accepted} of {} accepted", files.len());
}

fn nl(ty: u16, body: &[u8]) -> Vec<u8> {
    let mut m = Vec::new();
    m.extend_from_slice(&((16 + body.len()) as u32).to_ne_bytes());
    m.extend_from_slice(&ty.to_ne_bytes());
    m.extend_from_slice(&[0; 10]);
    m.extend_from_slice(body);
    m
}

fn attr(ty: u16, v: &[u8]) -> Vec<u8> {
    let mut a = Vec::new();
    a.extend_from_slice(&((4 + v.len()) as u16).to_ne_bytes());
    a.extend_from_slice(&ty.to_ne_bytes());
    a.extend_from_slice(v);
    a.resize((a.len() + 3) & !3, 0);
    a
}

#[test]
#[ignore = "rewrites the seed files"]
fn regenerate_seeds() {
    let dir = corpus();
    std::fs::create_dir_all(&dir).unwrap();
    let mut seeds: Vec<(&str, Vec<u8>)> = Vec::new();
    let req = |body: Request| {
        let mut v = vec![0u8];
        v.extend(fido_proto::encode(&ClientMsg::Request { id: 1, body }).unwrap());
        v
    };
    let remote = "127.0.0.1:8080".parse().unwrap();
    seeds.push(("offer", req(Request::NetOffer { remote, ring_len: 1 << 20, nonce: 42 })));
    seeds.push(("offer-v6", req(Request::NetOffer { remote: "[::1]:443".parse().unwrap(), ring_len: 1 << 16, nonce: 1 })));
    seeds.push(("withdraw", req(Request::NetWithdraw { offer: 3 })));
    seeds.push(("claim", req(Request::NetClaim)));
    seeds.push(("listen", req(Request::NetListen)));
    seeds.push(("unlisten", req(Request::NetUnlisten { key: "/net/listen/80/1@127.0.0.1@2@0@9".into() })));
    // A sock_diag answer for 127.0.0.1:4000 -> 127.0.0.1:80.
    let (l, r): (std::net::SocketAddr, std::net::SocketAddr) =
        ("127.0.0.1:4000".parse().unwrap(), "127.0.0.1:80".parse().unwrap());
    let body = fido_broker::netdiag::diag_request_body(l, r).unwrap();
    let mut msg = vec![0u8; 72];
    msg[0] = libc::AF_INET as u8;
    msg[1] = 1;
    msg[4..52].copy_from_slice(&body[8..56]);
    msg[68..72].copy_from_slice(&12345u32.to_ne_bytes());
    let mut tuple = vec![0u8; 38];
    tuple[0..4].copy_from_slice(&[127, 0, 0, 1]);
    tuple[16..20].copy_from_slice(&[127, 0, 0, 1]);
    tuple[32..34].copy_from_slice(&4000u16.to_be_bytes());
    tuple[34..36].copy_from_slice(&80u16.to_be_bytes());
    let mut diag = vec![1u8];
    diag.extend_from_slice(&tuple);
    diag.extend(nl(20, &msg));
    seeds.push(("diag", diag));
    let mut enoent = vec![1u8];
    enoent.extend_from_slice(&tuple);
    enoent.extend(nl(2, &(-libc::ENOENT).to_ne_bytes()));
    seeds.push(("diag-enoent", enoent));
    // Route: local; and unicast through interface 3.
    let mut rtm = [0u8; 12];
    rtm[0] = libc::AF_INET as u8;
    rtm[7] = 2;
    let mut route = vec![2u8];
    route.extend(nl(24, &rtm));
    seeds.push(("route-local", route));
    rtm[7] = 1;
    let mut b = rtm.to_vec();
    b.extend(attr(4, &3i32.to_ne_bytes()));
    let mut route = vec![2u8];
    route.extend(nl(24, &b));
    seeds.push(("route-oif", route));
    // Link: a veth whose peer is namespace id 0.
    let mut b = vec![0u8; 16];
    b.extend(attr(18, &attr(1, b"veth\0")));
    b.extend(attr(37, &0i32.to_ne_bytes()));
    let mut link = vec![3u8];
    link.extend(nl(16, &b));
    seeds.push(("link-veth", link));
    let mut b = vec![0u8; 4];
    b.extend(attr(1, &5i32.to_ne_bytes()));
    let mut nsid = vec![4u8];
    nsid.extend(nl(88, &b));
    seeds.push(("nsid", nsid));
    for (name, data) in seeds {
        std::fs::write(dir.join(format!("seed-{name}")), data).unwrap();
    }
}
