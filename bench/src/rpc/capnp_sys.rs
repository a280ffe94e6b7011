//! `capnp`: Cap'n Proto RPC (capnp-rpc 0.27, two-party VatNetwork) over a Unix
//! socket, single-threaded tokio runtimes (capnp-rpc is `!Send`: a `LocalSet`).
//! Cap'n Proto does no encode/decode pass: builders write the wire form and
//! readers read it in place, but the message is still copied through the socket.
//! Fairness (ANCHORS.md): the 64 MiB traversal limit lifted; ByteSeq built in place
//! with `init_data` (no extra copy), sequences as `List(Fixed)` / `List(Var)`.

use anyhow::Context as _;
use capnp_rpc::{rpc_twoparty_capnp::Side, twoparty, RpcSystem};
use futures::AsyncReadExt as _;
use tokio_util::compat::TokioAsyncReadCompatExt as _;

use super::bench_capnp::bench;
use super::data::{self, Dir, Seq};
use super::RpcClient;

/// Largest LEN a server accepts (capnp lists hold at most 2²⁹ − 1 elements).
const MAX_LEN: u64 = 100_000_000;

fn reader_options() -> capnp::message::ReaderOptions {
    let mut o = capnp::message::ReaderOptions::new();
    o.traversal_limit_in_words(None);
    o
}

fn network(
    s: tokio::net::UnixStream,
    side: Side,
) -> twoparty::VatNetwork<impl futures::AsyncRead + Unpin> {
    let (r, w) = s.compat().split();
    twoparty::VatNetwork::new(
        futures::io::BufReader::new(r),
        futures::io::BufWriter::new(w),
        side,
        reader_options(),
    )
}

struct Svc;

fn check_len(len: u64) -> Result<u32, capnp::Error> {
    if len > MAX_LEN {
        return Err(capnp::Error::failed(format!("LEN {len} over {MAX_LEN}")));
    }
    Ok(len as u32)
}

impl bench::Server for Svc {
    async fn null(
        self: std::rc::Rc<Self>,
        _: bench::NullParams,
        _: bench::NullResults,
    ) -> Result<(), capnp::Error> {
        Ok(())
    }

    async fn send_bytes(
        self: std::rc::Rc<Self>,
        p: bench::SendBytesParams,
        mut r: bench::SendBytesResults,
    ) -> Result<(), capnp::Error> {
        let d = p.get()?.get_data()?;
        r.get().set_sum(data::server_sum(data::sum_bytes(d)));
        Ok(())
    }

    async fn send_fixed(
        self: std::rc::Rc<Self>,
        p: bench::SendFixedParams,
        mut r: bench::SendFixedResults,
    ) -> Result<(), capnp::Error> {
        let l = p.get()?.get_seq()?;
        let s = l.iter().fold(0u64, |a, e| {
            a.wrapping_add(data::fixed_sum(&data::Fixed {
                i: e.get_i(),
                j: e.get_j(),
                d: e.get_d(),
            }))
        });
        r.get().set_sum(data::server_sum(s));
        Ok(())
    }

    async fn send_var(
        self: std::rc::Rc<Self>,
        p: bench::SendVarParams,
        mut r: bench::SendVarResults,
    ) -> Result<(), capnp::Error> {
        let l = p.get()?.get_seq()?;
        let mut s = 0u64;
        for e in l.iter() {
            s = s.wrapping_add(data::var_sum(e.get_s()?.as_bytes(), e.get_d()));
        }
        r.get().set_sum(data::server_sum(s));
        Ok(())
    }

    async fn recv_bytes(
        self: std::rc::Rc<Self>,
        p: bench::RecvBytesParams,
        mut r: bench::RecvBytesResults,
    ) -> Result<(), capnp::Error> {
        let p = p.get()?;
        let len = check_len(p.get_len())?;
        let mut res = r.get();
        let s = data::fill_bytes(res.reborrow().init_data(len * 10), p.get_seed());
        res.set_sum(data::server_sum(s));
        Ok(())
    }

    async fn recv_fixed(
        self: std::rc::Rc<Self>,
        p: bench::RecvFixedParams,
        mut r: bench::RecvFixedResults,
    ) -> Result<(), capnp::Error> {
        let p = p.get()?;
        let len = check_len(p.get_len())?;
        let mut res = r.get();
        let s = put_fixed(res.reborrow().init_seq(len), p.get_seed());
        res.set_sum(data::server_sum(s));
        Ok(())
    }

    async fn recv_var(
        self: std::rc::Rc<Self>,
        p: bench::RecvVarParams,
        mut r: bench::RecvVarResults,
    ) -> Result<(), capnp::Error> {
        let p = p.get()?;
        let len = check_len(p.get_len())?;
        let mut res = r.get();
        let s = put_var(res.reborrow().init_seq(len), p.get_seed());
        res.set_sum(data::server_sum(s));
        Ok(())
    }
}

fn put_fixed(
    mut l: capnp::struct_list::Builder<'_, super::bench_capnp::fixed::Owned>,
    seed: u64,
) -> u64 {
    let mut s = 0u64;
    for k in 0..l.len() {
        let f = data::fixed_at(seed, k as usize);
        s = s.wrapping_add(data::fixed_sum(&f));
        let mut e = l.reborrow().get(k);
        e.set_i(f.i);
        e.set_j(f.j);
        e.set_d(f.d);
    }
    s
}

fn put_var(
    mut l: capnp::struct_list::Builder<'_, super::bench_capnp::var::Owned>,
    seed: u64,
) -> u64 {
    let mut s = 0u64;
    for k in 0..l.len() {
        let st = data::var_str_at(seed, k as usize);
        let d = data::var_d_at(k as usize);
        s = s.wrapping_add(data::var_sum(&st, d));
        let mut e = l.reborrow().get(k);
        // The bytes are ASCII by construction.
        e.set_s(std::str::from_utf8(&st).expect("ascii"));
        e.set_d(d);
    }
    s
}

/// Binds `addr`, serves one connection until the client hangs up.
pub fn serve(addr: &str) -> anyhow::Result<()> {
    let rt = super::tonic_sys::runtime()?;
    let local = tokio::task::LocalSet::new();
    local.block_on(&rt, async {
        let _ = std::fs::remove_file(addr);
        let l = tokio::net::UnixListener::bind(addr).with_context(|| format!("binding {addr}"))?;
        super::emit_ready()?;
        let (s, _) = l.accept().await?;
        let client: bench::Client = capnp_rpc::new_client(Svc);
        let rpc = RpcSystem::new(Box::new(network(s, Side::Server)), Some(client.client));
        // Ends with an error when the client disconnects: that is the normal end.
        let _ = rpc.await;
        Ok(())
    })
}

pub struct Client {
    rt: tokio::runtime::Runtime,
    local: tokio::task::LocalSet,
    c: bench::Client,
}

impl Client {
    pub fn connect(addr: &str) -> anyhow::Result<Client> {
        let rt = super::tonic_sys::runtime()?;
        let local = tokio::task::LocalSet::new();
        let c = local.block_on(&rt, async {
            let s = tokio::net::UnixStream::connect(addr)
                .await
                .with_context(|| format!("connecting {addr}"))?;
            let mut rpc = RpcSystem::new(Box::new(network(s, Side::Client)), None);
            let c: bench::Client = rpc.bootstrap(Side::Server);
            tokio::task::spawn_local(rpc);
            anyhow::Ok(c)
        })?;
        Ok(Client { rt, local, c })
    }
}

impl RpcClient for Client {
    fn null(&mut self) -> anyhow::Result<()> {
        let c = &self.c;
        self.local.block_on(&self.rt, async {
            c.null_request().send().promise.await?;
            anyhow::Ok(())
        })
    }

    fn call(&mut self, seq: Seq, dir: Dir, len: usize, seed: u64) -> anyhow::Result<()> {
        let c = &self.c;
        let n = len as u32;
        self.local.block_on(&self.rt, async {
            match (seq, dir) {
                (Seq::Byte, Dir::Send) => {
                    let mut req = c.send_bytes_request();
                    let want = data::fill_bytes(req.get().init_data(n * 10), seed);
                    let r = req.send().promise.await?;
                    data::check("capnp send", r.get()?.get_sum(), want)
                }
                (Seq::Fixed, Dir::Send) => {
                    let mut req = c.send_fixed_request();
                    let want = put_fixed(req.get().init_seq(n), seed);
                    let r = req.send().promise.await?;
                    data::check("capnp send", r.get()?.get_sum(), want)
                }
                (Seq::Var, Dir::Send) => {
                    let mut req = c.send_var_request();
                    let want = put_var(req.get().init_seq(n), seed);
                    let r = req.send().promise.await?;
                    data::check("capnp send", r.get()?.get_sum(), want)
                }
                (Seq::Byte, Dir::Recv) => {
                    let mut req = c.recv_bytes_request();
                    req.get().set_len(len as u64);
                    req.get().set_seed(seed);
                    let r = req.send().promise.await?;
                    let r = r.get()?;
                    let d = r.get_data()?;
                    anyhow::ensure!(d.len() == seq.elements(len), "short ByteSeq");
                    data::check("capnp recv", data::sum_bytes(d), r.get_sum())
                }
                (Seq::Fixed, Dir::Recv) => {
                    let mut req = c.recv_fixed_request();
                    req.get().set_len(len as u64);
                    req.get().set_seed(seed);
                    let r = req.send().promise.await?;
                    let r = r.get()?;
                    let l = r.get_seq()?;
                    anyhow::ensure!(l.len() == n, "short FixedSeq");
                    let got = l.iter().fold(0u64, |a, e| {
                        a.wrapping_add(data::fixed_sum(&data::Fixed {
                            i: e.get_i(),
                            j: e.get_j(),
                            d: e.get_d(),
                        }))
                    });
                    data::check("capnp recv", got, r.get_sum())
                }
                (Seq::Var, Dir::Recv) => {
                    let mut req = c.recv_var_request();
                    req.get().set_len(len as u64);
                    req.get().set_seed(seed);
                    let r = req.send().promise.await?;
                    let r = r.get()?;
                    let l = r.get_seq()?;
                    anyhow::ensure!(l.len() == n, "short VarSeq");
                    let mut got = 0u64;
                    for e in l.iter() {
                        got = got.wrapping_add(data::var_sum(e.get_s()?.as_bytes(), e.get_d()));
                    }
                    data::check("capnp recv", got, r.get_sum())
                }
            }
        })
    }
}
