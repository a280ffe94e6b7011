//! The export `fido blk nbd` serves: a Fido block service (`blk:NAME`), one
//! [`BlkClient`] (one Fido connection) per NBD connection, so multi-conn
//! clients get parallel paths to the storage domain.
//!
//! WRITE payloads are read from the socket into a [`Buf`] of our arena and
//! sent by pointer (the storage domain hands them to the kernel in place);
//! READ replies are the storage domain's buffers, written to the socket from
//! the received [`Msg`]'s segments. A storage domain that dies fails the
//! requests in flight with EIO; the next request connects again (the
//! client's reconnect), so NBD clients resume when it is back.

use std::io;
use std::sync::Arc;
use std::time::Duration;

use fido::{Buf, Domain, Msg};
use fido_blk::proto::{self, Info};
use fido_blk::{BlkClient, BlkError};

use crate::export::{Completer, Completion, Export, ExportInfo, Op, ReadData, Request, Run, Submitter};

/// The block service `blk:NAME`, reached from `domain`.
pub struct BlkExport {
    domain: Domain,
    name: String,
}

impl BlkExport {
    /// Checks the name now; connections are made per NBD connection.
    pub fn new(domain: Domain, name: &str) -> io::Result<BlkExport> {
        proto::service_name(name).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?;
        Ok(BlkExport { domain, name: name.to_string() })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The device's INFO, from a fresh connection.
    pub fn probe(&self) -> io::Result<Info> {
        Ok(self.connect()?.info())
    }

    fn connect(&self) -> io::Result<BlkClient> {
        BlkClient::connect(&self.domain, &self.name)
            .map_err(|e| io::Error::new(io::ErrorKind::NotConnected, format!("block device {:?}: {e}", self.name)))
    }
}

/// What NBD is told about a fido-blk device.
pub fn export_info(i: &Info) -> ExportInfo {
    let block = i.logical_block;
    ExportInfo {
        size: i.size,
        block_size: block,
        max_transfer: i.max_transfer,
        // DISCARD and WRITE_ZEROES are bounded only by the 32-bit length.
        max_discard: u32::MAX / block * block,
        queue_depth: i.queue_depth.max(1),
        read_only: i.read_only(),
        flush: i.flags & proto::INFO_FLUSH != 0,
        fua: i.flags & proto::INFO_FUA != 0,
        trim: i.flags & proto::INFO_DISCARD != 0,
        // Every storage domain does WRITE_ZEROES (INFO_WRITE_ZEROES only says
        // whether it avoids writing zeros).
        write_zeroes: true,
        multi_conn: i.flags & proto::INFO_CAN_MULTI_CONN != 0,
    }
}

impl Export for BlkExport {
    type Submitter = BlkSubmitter;
    type Completer = BlkCompleter;

    fn open(&self) -> io::Result<(ExportInfo, BlkSubmitter, BlkCompleter)> {
        let client = Arc::new(self.connect()?);
        let info = export_info(&client.info());
        Ok((info, BlkSubmitter { client: client.clone() }, BlkCompleter { client }))
    }
}

pub struct BlkSubmitter {
    client: Arc<BlkClient>,
}

impl Submitter for BlkSubmitter {
    type WriteBuf = Buf;

    fn write_buf(&mut self, len: usize) -> io::Result<Buf> {
        self.client.alloc(len).map_err(|e| io::Error::new(io::ErrorKind::OutOfMemory, e.to_string()))
    }

    fn submit(&mut self, r: Request<Buf>) -> Result<(), i32> {
        let c = &self.client;
        let sent = match r.op {
            Op::Read => c.submit_read(r.tag, r.offset, r.len),
            Op::Write(buf) => c.submit_write(r.tag, r.offset, vec![buf], r.fua),
            Op::Flush => c.submit_flush(r.tag),
            Op::Trim => c.submit_discard(r.tag, r.offset, r.len, r.fua),
            Op::WriteZeroes { may_unmap } => c.submit_write_zeroes(r.tag, r.offset, r.len, r.fua, !may_unmap),
        };
        sent.map_err(|e| {
            tracing::debug!(name = c.name(), "fido-blk request not sent: {e}");
            e.errno()
        })
    }
}

pub struct BlkCompleter {
    client: Arc<BlkClient>,
}

impl Completer for BlkCompleter {
    type Data = MsgData;

    fn complete(&mut self) -> io::Result<Completion<MsgData>> {
        loop {
            match self.client.complete(Duration::from_secs(1)) {
                Ok(c) => return Ok(completion(c)),
                // A slow storage domain: keep waiting (a dead one fails the
                // requests with Disconnected, a hung one is declared gone
                // by the broker's heartbeats).
                Err(BlkError::Timeout) => continue,
                Err(e) => return Err(io::Error::other(e.to_string())),
            }
        }
    }

    fn try_complete(&mut self) -> io::Result<Option<Completion<MsgData>>> {
        match self.client.complete(Duration::ZERO) {
            Ok(c) => Ok(Some(completion(c))),
            Err(BlkError::Timeout) => Ok(None),
            Err(e) => Err(io::Error::other(e.to_string())),
        }
    }
}

fn completion(c: fido_blk::Completion) -> Completion<MsgData> {
    Completion { tag: c.id, result: c.result.map(|m| m.map(MsgData)).map_err(|e| e.errno()) }
}

/// READ data: the storage domain's buffers, held until the reply is sent.
pub struct MsgData(Msg);

// SAFETY: the segments are views of the storage domain's arena, mapped in this
// process while the Msg lives (dropping it releases them); the server only
// passes the pointers to sendmsg.
unsafe impl ReadData for MsgData {
    fn runs(&self, out: &mut Vec<Run>) {
        out.extend(self.0.segments().map(|s| Run::Data { ptr: s.as_ptr(), len: s.len() }));
    }
}
