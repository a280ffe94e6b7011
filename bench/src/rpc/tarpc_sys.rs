//! `tarpc`: tarpc 0.38 (serde + bincode through tokio-serde, length-delimited
//! frames) over a Unix socket, single-threaded tokio runtimes on both ends.
//! Fairness (ANCHORS.md): ByteSeq as `serde_bytes::ByteBuf` (bincode writes it as
//! one block, not byte by byte), tokio-util's 8 MiB frame limit raised, the call
//! deadline (10 s by default) raised above the point budget.

use std::time::{Duration, Instant};

use anyhow::Context as _;
use futures::StreamExt as _;
use serde_bytes::ByteBuf;
use tarpc::server::Channel as _;
use tarpc::tokio_serde::formats::Bincode;
use tarpc::tokio_util::codec::LengthDelimitedCodec;

use super::data::{self, Dir, Fixed, Seq, Var};
use super::RpcClient;

/// Largest LEN a server accepts.
const MAX_LEN: u64 = 100_000_000;

#[tarpc::service]
pub trait Bench {
    async fn null();
    async fn send_bytes(data: ByteBuf) -> u64;
    async fn send_fixed(seq: Vec<Fixed>) -> u64;
    async fn send_var(seq: Vec<Var>) -> u64;
    async fn recv_bytes(len: u64, seed: u64) -> Option<(ByteBuf, u64)>;
    async fn recv_fixed(len: u64, seed: u64) -> Option<(Vec<Fixed>, u64)>;
    async fn recv_var(len: u64, seed: u64) -> Option<(Vec<Var>, u64)>;
}

#[derive(Clone)]
struct Svc;

fn build_fixed(len: usize, seed: u64) -> (Vec<Fixed>, u64) {
    let v: Vec<Fixed> = (0..len).map(|k| data::fixed_at(seed, k)).collect();
    let s = data::sum_fixed(&v);
    (v, s)
}

fn build_var(len: usize, seed: u64) -> (Vec<Var>, u64) {
    let v: Vec<Var> = (0..len).map(|k| data::var_at(seed, k)).collect();
    let s = data::sum_var(&v);
    (v, s)
}

impl Bench for Svc {
    async fn null(self, _: tarpc::context::Context) {}

    async fn send_bytes(self, _: tarpc::context::Context, d: ByteBuf) -> u64 {
        data::server_sum(data::sum_bytes(&d))
    }

    async fn send_fixed(self, _: tarpc::context::Context, seq: Vec<Fixed>) -> u64 {
        data::server_sum(data::sum_fixed(&seq))
    }

    async fn send_var(self, _: tarpc::context::Context, seq: Vec<Var>) -> u64 {
        data::server_sum(data::sum_var(&seq))
    }

    async fn recv_bytes(
        self,
        _: tarpc::context::Context,
        len: u64,
        seed: u64,
    ) -> Option<(ByteBuf, u64)> {
        if len > MAX_LEN {
            return None;
        }
        let mut v = vec![0u8; Seq::Byte.elements(len as usize)];
        let s = data::fill_bytes(&mut v, seed);
        Some((ByteBuf::from(v), data::server_sum(s)))
    }

    async fn recv_fixed(
        self,
        _: tarpc::context::Context,
        len: u64,
        seed: u64,
    ) -> Option<(Vec<Fixed>, u64)> {
        if len > MAX_LEN {
            return None;
        }
        let (v, s) = build_fixed(len as usize, seed);
        Some((v, data::server_sum(s)))
    }

    async fn recv_var(
        self,
        _: tarpc::context::Context,
        len: u64,
        seed: u64,
    ) -> Option<(Vec<Var>, u64)> {
        if len > MAX_LEN {
            return None;
        }
        let (v, s) = build_var(len as usize, seed);
        Some((v, data::server_sum(s)))
    }
}

fn codec() -> LengthDelimitedCodec {
    LengthDelimitedCodec::builder()
        .max_frame_length(usize::MAX)
        .new_codec()
}

/// Binds `addr`, serves one connection until the client hangs up.
pub fn serve(addr: &str) -> anyhow::Result<()> {
    super::tonic_sys::runtime()?.block_on(async {
        let _ = std::fs::remove_file(addr);
        let l = tokio::net::UnixListener::bind(addr).with_context(|| format!("binding {addr}"))?;
        super::emit_ready()?;
        let (s, _) = l.accept().await?;
        let framed = tokio_util_framed(s);
        let transport = tarpc::serde_transport::new(framed, Bincode::default());
        tarpc::server::BaseChannel::with_defaults(transport)
            .execute(Svc.serve())
            .for_each(|f| async move {
                tokio::spawn(f);
            })
            .await;
        Ok(())
    })
}

fn tokio_util_framed(
    s: tokio::net::UnixStream,
) -> tarpc::tokio_util::codec::Framed<tokio::net::UnixStream, LengthDelimitedCodec> {
    tarpc::tokio_util::codec::Framed::new(s, codec())
}

pub struct Client {
    rt: tokio::runtime::Runtime,
    c: BenchClient,
}

impl Client {
    pub fn connect(addr: &str) -> anyhow::Result<Client> {
        let rt = super::tonic_sys::runtime()?;
        let c = rt.block_on(async {
            let s = tokio::net::UnixStream::connect(addr)
                .await
                .with_context(|| format!("connecting {addr}"))?;
            let transport = tarpc::serde_transport::new(tokio_util_framed(s), Bincode::default());
            anyhow::Ok(BenchClient::new(tarpc::client::Config::default(), transport).spawn())
        })?;
        Ok(Client { rt, c })
    }
}

/// A context whose deadline is far beyond any point's budget.
fn ctx() -> tarpc::context::Context {
    let mut c = tarpc::context::current();
    c.deadline = Instant::now() + Duration::from_secs(3600);
    c
}

impl RpcClient for Client {
    fn null(&mut self) -> anyhow::Result<()> {
        self.rt.block_on(self.c.null(ctx()))?;
        Ok(())
    }

    fn call(&mut self, seq: Seq, dir: Dir, len: usize, seed: u64) -> anyhow::Result<()> {
        let c = &self.c;
        self.rt.block_on(async {
            match (seq, dir) {
                (Seq::Byte, Dir::Send) => {
                    let mut v = vec![0u8; seq.elements(len)];
                    let want = data::fill_bytes(&mut v, seed);
                    let got = c.send_bytes(ctx(), ByteBuf::from(v)).await?;
                    data::check("tarpc send", got, want)
                }
                (Seq::Fixed, Dir::Send) => {
                    let (v, want) = build_fixed(len, seed);
                    data::check("tarpc send", c.send_fixed(ctx(), v).await?, want)
                }
                (Seq::Var, Dir::Send) => {
                    let (v, want) = build_var(len, seed);
                    data::check("tarpc send", c.send_var(ctx(), v).await?, want)
                }
                (Seq::Byte, Dir::Recv) => {
                    let (d, sum) = c
                        .recv_bytes(ctx(), len as u64, seed)
                        .await?
                        .context("server refused LEN")?;
                    anyhow::ensure!(d.len() == seq.elements(len), "short ByteSeq");
                    data::check("tarpc recv", data::sum_bytes(&d), sum)
                }
                (Seq::Fixed, Dir::Recv) => {
                    let (v, sum) = c
                        .recv_fixed(ctx(), len as u64, seed)
                        .await?
                        .context("server refused LEN")?;
                    anyhow::ensure!(v.len() == len, "short FixedSeq");
                    data::check("tarpc recv", data::sum_fixed(&v), sum)
                }
                (Seq::Var, Dir::Recv) => {
                    let (v, sum) = c
                        .recv_var(ctx(), len as u64, seed)
                        .await?
                        .context("server refused LEN")?;
                    anyhow::ensure!(v.len() == len, "short VarSeq");
                    data::check("tarpc recv", data::sum_var(&v), sum)
                }
            }
        })
    }
}
