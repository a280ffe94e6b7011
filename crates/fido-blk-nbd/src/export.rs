//! What the NBD server serves: an [`Export`] opens one backend connection per
//! NBD connection, split into a [`Submitter`] (driven by the connection's
//! reader thread) and a [`Completer`] (driven by its writer thread), so many
//! requests are in flight and complete in any order.

use std::io;
use std::ops::DerefMut;

/// The shape of an export, as the backend reports it when a connection opens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExportInfo {
    /// Bytes.
    pub size: u64,
    /// Requests must be aligned to this (a power of two, 512..=65536): NBD's
    /// minimum block size.
    pub block_size: u32,
    /// The largest READ or WRITE the backend takes, a multiple of
    /// `block_size`; longer NBD requests are split.
    pub max_transfer: u32,
    /// The same for TRIM and WRITE_ZEROES (nothing is transferred, so
    /// backends often take more).
    pub max_discard: u32,
    /// Backend requests in flight per connection the backend accepts.
    pub queue_depth: u32,
    pub read_only: bool,
    /// FLUSH makes completed writes durable.
    pub flush: bool,
    /// A write with FUA is durable when it completes.
    pub fua: bool,
    pub trim: bool,
    pub write_zeroes: bool,
    /// Connections see each other's completed writes, and a FLUSH on one
    /// covers writes completed on all (NBD_FLAG_CAN_MULTI_CONN).
    pub multi_conn: bool,
}

impl ExportInfo {
    /// Checks what the server relies on; a backend that reports nonsense is
    /// refused rather than served.
    pub fn validate(&self) -> Result<(), String> {
        if !self.block_size.is_power_of_two() || !(512..=65536).contains(&self.block_size) {
            return Err(format!("block size {} is not a power of two in 512..=65536", self.block_size));
        }
        if self.max_transfer < self.block_size || self.max_transfer % self.block_size != 0 {
            return Err(format!(
                "max transfer {} is not a positive multiple of the block size {}",
                self.max_transfer, self.block_size
            ));
        }
        if self.max_discard < self.block_size || self.max_discard % self.block_size != 0 {
            return Err(format!(
                "max discard {} is not a positive multiple of the block size {}",
                self.max_discard, self.block_size
            ));
        }
        if self.size % self.block_size as u64 != 0 {
            return Err(format!("size {} is not a multiple of the block size {}", self.size, self.block_size));
        }
        if self.queue_depth == 0 {
            return Err("queue depth 0".into());
        }
        Ok(())
    }
}

/// What a backend request does.
#[derive(Debug)]
pub enum Op<W> {
    Read,
    /// The payload, exactly `len` bytes, in a buffer from [`Submitter::write_buf`].
    Write(W),
    Flush,
    /// Discard (the range may read back as anything, zeroes included).
    Trim,
    /// The range reads back as zeroes; `may_unmap`: it may become a hole.
    WriteZeroes { may_unmap: bool },
}

/// One backend request. The server validated it against [`ExportInfo`]
/// (aligned, in range, `0 < len <= max_transfer` (TRIM, WRITE_ZEROES:
/// `max_discard`); FLUSH: offset and len 0).
#[derive(Debug)]
pub struct Request<W> {
    /// Unique among this connection's requests in flight.
    pub tag: u64,
    pub op: Op<W>,
    pub offset: u64,
    pub len: u32,
    /// Durable before completion (only when the export has `fua`).
    pub fua: bool,
}

/// The submitting half of a backend connection.
pub trait Submitter: Send + 'static {
    /// Memory a WRITE payload is read into from the socket (the backend's own
    /// kind of buffer, so the payload is never copied again).
    type WriteBuf: DerefMut<Target = [u8]> + Send + 'static;

    /// A buffer of exactly `len` bytes.
    fn write_buf(&mut self, len: usize) -> io::Result<Self::WriteBuf>;

    /// Starts a request; its completion comes from the [`Completer`]. The
    /// server never has more than `queue_depth` requests in flight.
    /// `Err(errno)`: the request failed before it started (it will have no
    /// completion), e.g. the backend is unreachable for now; the connection
    /// goes on and later requests are tried again.
    fn submit(&mut self, request: Request<Self::WriteBuf>) -> Result<(), i32>;

    /// The allocation state of `[offset, offset+len)` as `(length, STATE_*
    /// flags)` runs in order. The default knows nothing: all data.
    fn extents(&mut self, offset: u64, len: u32) -> io::Result<Vec<(u32, u32)>> {
        let _ = offset;
        Ok(vec![(len, 0)])
    }
}

/// The completing half of a backend connection.
pub trait Completer: Send + 'static {
    type Data: ReadData;

    /// Waits for the next completion of a submitted request (any order). An
    /// error means the backend is broken for good: requests in flight will
    /// not complete, and the NBD connection closes. Only called while at
    /// least one request is in flight.
    fn complete(&mut self) -> io::Result<Completion<Self::Data>>;

    /// A completion that is already there, without waiting (`Ok(None)`:
    /// none). Lets the server send a batch of replies at once.
    fn try_complete(&mut self) -> io::Result<Option<Completion<Self::Data>>> {
        Ok(None)
    }
}

/// The outcome of one request.
#[derive(Debug)]
pub struct Completion<D> {
    pub tag: u64,
    /// `Ok(Some(data))` for a READ, `Ok(None)` for everything else, or a
    /// positive errno.
    pub result: Result<Option<D>, i32>,
}

/// A piece of a READ reply, as the backend has it.
#[derive(Clone, Copy, Debug)]
pub enum Run {
    /// `len` readable bytes at `ptr` (valid while the [`ReadData`] lives).
    Data { ptr: *const u8, len: usize },
    /// `len` bytes that read as zero (a hole, if the backend knows one).
    Zeroes { len: usize },
}

/// The data of a completed READ.
///
/// # Safety
/// Every `Run::Data` that `runs` reports must point at `len` bytes that stay
/// mapped and readable until `self` is dropped. They may be memory another
/// process can write: the server only hands the pointers to the kernel
/// (sendmsg), it never forms a reference to them.
pub unsafe trait ReadData: Send + 'static {
    /// Appends the runs, in order; their lengths add up to the request's.
    fn runs(&self, out: &mut Vec<Run>);
}

/// A backend that NBD connections open.
pub trait Export: Send + Sync + 'static {
    type Submitter: Submitter;
    type Completer: Completer;

    /// Opens a backend connection (one per NBD connection, so that multi-conn
    /// clients get parallel backend paths).
    fn open(&self) -> io::Result<(ExportInfo, Self::Submitter, Self::Completer)>;
}
