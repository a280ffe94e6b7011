//! Descriptor and operation checks the broker runs before it hands a
//! transfer over. They run on the broker's main loop: none of them blocks.

use std::os::fd::BorrowedFd;

use fido_proto::{PipeFdKind, PipeOp};

/// Classifies a descriptor handed to the engine and checks it can play its
/// role. `source`: it will be read; else written.
pub fn check_fd(fd: BorrowedFd<'_>, source: bool) -> Result<PipeFdKind, String> {
    let role = if source { "source" } else { "sink" };
    let flags = rustix::fs::fcntl_getfl(fd)
        .map_err(|e| format!("{role}: not a usable descriptor ({e})"))?;
    if flags.contains(rustix::fs::OFlags::PATH) {
        return Err(format!(
            "{role}: an O_PATH descriptor cannot be read or written"
        ));
    }
    let st = rustix::fs::fstat(fd).map_err(|e| format!("{role}: fstat failed ({e})"))?;
    let ft = rustix::fs::FileType::from_raw_mode(st.st_mode);
    let kind = match ft {
        rustix::fs::FileType::RegularFile => PipeFdKind::File,
        rustix::fs::FileType::Fifo => PipeFdKind::Stream,
        rustix::fs::FileType::Socket => {
            let t = rustix::net::sockopt::socket_type(fd)
                .map_err(|e| format!("{role}: socket type unknown ({e})"))?;
            if t != rustix::net::SocketType::STREAM {
                return Err(format!(
                    "{role}: a {t:?} socket; pipes move bytes between stream sockets only"
                ));
            }
            PipeFdKind::Stream
        }
        other => {
            return Err(format!(
                "{role}: a {other:?}; pipes take regular files, stream sockets and pipes"
            ))
        }
    };
    let mode = flags & rustix::fs::OFlags::RWMODE;
    if source && mode == rustix::fs::OFlags::WRONLY {
        return Err(format!(
            "{role}: opened write-only (O_WRONLY); a source must be readable"
        ));
    }
    if !source && mode == rustix::fs::OFlags::RDONLY {
        return Err(format!(
            "{role}: opened read-only (O_RDONLY); a sink must be writable"
        ));
    }
    if !source && kind == PipeFdKind::File && flags.contains(rustix::fs::OFlags::APPEND) {
        return Err(format!(
            "{role}: opened O_APPEND; the engine writes at explicit offsets, which O_APPEND ignores"
        ));
    }
    Ok(kind)
}

/// Does `op` fit a pipe whose descriptors are of these kinds?
pub fn check_op(op: &PipeOp, source: PipeFdKind, sink: PipeFdKind) -> Result<(), String> {
    let want_src = if op.source_is_file() {
        PipeFdKind::File
    } else {
        PipeFdKind::Stream
    };
    let want_dst = if op.sink_is_file() {
        PipeFdKind::File
    } else {
        PipeFdKind::Stream
    };
    let name = |k: PipeFdKind| match k {
        PipeFdKind::File => "a regular file",
        PipeFdKind::Stream => "a stream (socket or pipe)",
    };
    if source != want_src {
        return Err(format!(
            "{op:?} needs {} as source; this one is {}",
            name(want_src),
            name(source)
        ));
    }
    if sink != want_dst {
        return Err(format!(
            "{op:?} needs {} as sink; this one is {}",
            name(want_dst),
            name(sink)
        ));
    }
    Ok(())
}

/// A file→file copy within one file must not overlap: chunked copies are not
/// `memmove`, the result would repeat data.
pub fn check_overlap(op: &PipeOp, src: BorrowedFd<'_>, dst: BorrowedFd<'_>) -> Result<(), String> {
    let PipeOp::FileToFile {
        in_off,
        len,
        out_off,
    } = *op
    else {
        return Ok(());
    };
    let (Ok(a), Ok(b)) = (rustix::fs::fstat(src), rustix::fs::fstat(dst)) else {
        return Ok(());
    };
    if (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)
        && len > 0
        && in_off < out_off + len
        && out_off < in_off + len
    {
        return Err(format!(
            "source range {in_off}+{len} and sink range {out_off}+{len} overlap in the same file"
        ));
    }
    Ok(())
}
