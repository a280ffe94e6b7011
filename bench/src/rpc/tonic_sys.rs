//! `tonic`: gRPC (tonic 0.14, prost) over a Unix socket, single-threaded tokio
//! runtimes on both ends. Fairness (ANCHORS.md): the 4 MiB decode limit (and the
//! encode limit) raised to `usize::MAX`, ByteSeq as `bytes::Bytes` (prost decodes
//! it without copying into a `Vec`), HTTP/2 stream and connection windows raised
//! to 64 MiB so large messages are not throttled by flow control.

use anyhow::Context as _;
use prost::bytes::Bytes;
use tonic::{Request, Response, Status};

use super::data::{self, Dir, Seq};
use super::pb::{self, bench_client::BenchClient, bench_server};
use super::RpcClient;

/// HTTP/2 flow-control windows (both ends).
pub(crate) const WINDOW: u32 = 64 << 20;
/// Largest LEN a server accepts (10× the largest case).
pub(crate) const MAX_LEN: u64 = 100_000_000;

pub(crate) fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?)
}

struct Svc;

fn check_len(len: u64) -> Result<usize, Status> {
    if len > MAX_LEN {
        return Err(Status::invalid_argument(format!(
            "LEN {len} over {MAX_LEN}"
        )));
    }
    Ok(len as usize)
}

fn sum(s: u64) -> Response<pb::Sum> {
    Response::new(pb::Sum {
        sum: data::server_sum(s),
    })
}

#[tonic::async_trait]
impl bench_server::Bench for Svc {
    async fn null(&self, _: Request<pb::Empty>) -> Result<Response<pb::Empty>, Status> {
        Ok(Response::new(pb::Empty {}))
    }

    async fn send_bytes(&self, r: Request<pb::ByteSeq>) -> Result<Response<pb::Sum>, Status> {
        Ok(sum(data::sum_bytes(&r.get_ref().data)))
    }

    async fn send_fixed(&self, r: Request<pb::FixedSeq>) -> Result<Response<pb::Sum>, Status> {
        Ok(sum(r.get_ref().seq.iter().fold(0u64, |a, f| {
            a.wrapping_add(data::fixed_sum(&data::Fixed {
                i: f.i,
                j: f.j,
                d: f.d,
            }))
        })))
    }

    async fn send_var(&self, r: Request<pb::VarSeq>) -> Result<Response<pb::Sum>, Status> {
        Ok(sum(r.get_ref().seq.iter().fold(0u64, |a, v| {
            a.wrapping_add(data::var_sum(v.s.as_bytes(), v.d))
        })))
    }

    async fn recv_bytes(
        &self,
        r: Request<pb::RecvReq>,
    ) -> Result<Response<pb::ByteSeqReply>, Status> {
        let len = check_len(r.get_ref().len)?;
        let mut v = vec![0u8; Seq::Byte.elements(len)];
        let s = data::fill_bytes(&mut v, r.get_ref().seed);
        Ok(Response::new(pb::ByteSeqReply {
            data: Bytes::from(v),
            sum: data::server_sum(s),
        }))
    }

    async fn recv_fixed(
        &self,
        r: Request<pb::RecvReq>,
    ) -> Result<Response<pb::FixedSeqReply>, Status> {
        let len = check_len(r.get_ref().len)?;
        let seed = r.get_ref().seed;
        let (seq, s) = build_fixed(len, seed);
        Ok(Response::new(pb::FixedSeqReply {
            seq,
            sum: data::server_sum(s),
        }))
    }

    async fn recv_var(&self, r: Request<pb::RecvReq>) -> Result<Response<pb::VarSeqReply>, Status> {
        let len = check_len(r.get_ref().len)?;
        let (seq, s) = build_var(len, r.get_ref().seed);
        Ok(Response::new(pb::VarSeqReply {
            seq,
            sum: data::server_sum(s),
        }))
    }
}

fn build_fixed(len: usize, seed: u64) -> (Vec<pb::Fixed>, u64) {
    let mut s = 0u64;
    let v = (0..len)
        .map(|k| {
            let f = data::fixed_at(seed, k);
            s = s.wrapping_add(data::fixed_sum(&f));
            pb::Fixed {
                i: f.i,
                j: f.j,
                d: f.d,
            }
        })
        .collect();
    (v, s)
}

fn build_var(len: usize, seed: u64) -> (Vec<pb::Var>, u64) {
    let mut s = 0u64;
    let v = (0..len)
        .map(|k| {
            let v = data::var_at(seed, k);
            s = s.wrapping_add(data::var_sum(v.s.as_bytes(), v.d));
            pb::Var { s: v.s, d: v.d }
        })
        .collect();
    (v, s)
}

/// Binds `addr` and serves until killed.
pub fn serve(addr: &str) -> anyhow::Result<()> {
    runtime()?.block_on(async {
        let _ = std::fs::remove_file(addr);
        let l = tokio::net::UnixListener::bind(addr).with_context(|| format!("binding {addr}"))?;
        super::emit_ready()?;
        tonic::transport::Server::builder()
            .initial_stream_window_size(WINDOW)
            .initial_connection_window_size(WINDOW)
            .add_service(
                bench_server::BenchServer::new(Svc)
                    .max_decoding_message_size(usize::MAX)
                    .max_encoding_message_size(usize::MAX),
            )
            .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(l))
            .await?;
        Ok(())
    })
}

/// A tonic channel to a Unix socket (the URI is a placeholder tonic requires).
pub(crate) async fn channel(addr: &str) -> anyhow::Result<tonic::transport::Channel> {
    let path = addr.to_string();
    tonic::transport::Endpoint::try_from("http://[::1]:50051")?
        .initial_stream_window_size(WINDOW)
        .initial_connection_window_size(WINDOW)
        .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
            let p = path.clone();
            async move {
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                    tokio::net::UnixStream::connect(p).await?,
                ))
            }
        }))
        .await
        .with_context(|| format!("connecting {addr}"))
}

pub struct Client {
    rt: tokio::runtime::Runtime,
    c: BenchClient<tonic::transport::Channel>,
}

impl Client {
    pub fn connect(addr: &str) -> anyhow::Result<Client> {
        let rt = runtime()?;
        let ch = rt.block_on(channel(addr))?;
        let c = BenchClient::new(ch)
            .max_decoding_message_size(usize::MAX)
            .max_encoding_message_size(usize::MAX);
        Ok(Client { rt, c })
    }
}

impl RpcClient for Client {
    fn null(&mut self) -> anyhow::Result<()> {
        self.rt.block_on(self.c.null(pb::Empty {}))?;
        Ok(())
    }

    fn call(&mut self, seq: Seq, dir: Dir, len: usize, seed: u64) -> anyhow::Result<()> {
        let c = &mut self.c;
        self.rt.block_on(async {
            match (seq, dir) {
                (Seq::Byte, Dir::Send) => {
                    let mut v = vec![0u8; seq.elements(len)];
                    let want = data::fill_bytes(&mut v, seed);
                    let got = c
                        .send_bytes(pb::ByteSeq {
                            data: Bytes::from(v),
                        })
                        .await?;
                    data::check("tonic send", got.get_ref().sum, want)
                }
                (Seq::Fixed, Dir::Send) => {
                    let (v, want) = build_fixed(len, seed);
                    let got = c.send_fixed(pb::FixedSeq { seq: v }).await?;
                    data::check("tonic send", got.get_ref().sum, want)
                }
                (Seq::Var, Dir::Send) => {
                    let (v, want) = build_var(len, seed);
                    let got = c.send_var(pb::VarSeq { seq: v }).await?;
                    data::check("tonic send", got.get_ref().sum, want)
                }
                (Seq::Byte, Dir::Recv) => {
                    let r = c
                        .recv_bytes(pb::RecvReq {
                            len: len as u64,
                            seed,
                        })
                        .await?;
                    let r = r.get_ref();
                    anyhow::ensure!(r.data.len() == seq.elements(len), "short ByteSeq");
                    data::check("tonic recv", data::sum_bytes(&r.data), r.sum)
                }
                (Seq::Fixed, Dir::Recv) => {
                    let r = c
                        .recv_fixed(pb::RecvReq {
                            len: len as u64,
                            seed,
                        })
                        .await?;
                    let r = r.get_ref();
                    anyhow::ensure!(r.seq.len() == len, "short FixedSeq");
                    let got = r.seq.iter().fold(0u64, |a, f| {
                        a.wrapping_add(data::fixed_sum(&data::Fixed {
                            i: f.i,
                            j: f.j,
                            d: f.d,
                        }))
                    });
                    data::check("tonic recv", got, r.sum)
                }
                (Seq::Var, Dir::Recv) => {
                    let r = c
                        .recv_var(pb::RecvReq {
                            len: len as u64,
                            seed,
                        })
                        .await?;
                    let r = r.get_ref();
                    anyhow::ensure!(r.seq.len() == len, "short VarSeq");
                    let got = r.seq.iter().fold(0u64, |a, v| {
                        a.wrapping_add(data::var_sum(v.s.as_bytes(), v.d))
                    });
                    data::check("tonic recv", got, r.sum)
                }
            }
        })
    }
}
