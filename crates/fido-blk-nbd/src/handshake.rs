//! Fixed newstyle negotiation: the options a client may send before
//! transmission, each validated against its declared length.

use std::io;

use crate::export::{Export, ExportInfo};
use crate::proto::*;
use crate::server::ServerConfig;
use crate::sock::Stream;

/// Options longer than this are refused (NBD_REP_ERR_TOO_BIG) and skipped; a
/// name or a meta context query is at most 4 KiB, so 64 KiB covers any honest
/// option.
const MAX_OPTION_LEN: u32 = 64 << 10;
/// Longer than this and the option is not even skipped: the connection closes.
const MAX_SKIPPED_OPTION_LEN: u32 = 16 << 20;
/// A client that has not reached transmission after this many options is
/// playing games: the connection closes.
const MAX_OPTIONS: usize = 4096;

/// What negotiation ended with.
pub(crate) struct Negotiated<S, C> {
    pub info: ExportInfo,
    pub submitter: S,
    pub completer: C,
    /// The client asked for structured replies.
    pub structured: bool,
    /// The client selected `base:allocation` (BLOCK_STATUS is allowed).
    pub base_allocation: bool,
}

type Opened<E> = Negotiated<<E as Export>::Submitter, <E as Export>::Completer>;

fn reply(s: &Stream, option: u32, kind: u32, data: &[u8]) -> io::Result<()> {
    let mut b = Vec::with_capacity(20 + data.len());
    b.extend_from_slice(&option_reply_header(option, kind, data.len() as u32));
    b.extend_from_slice(data);
    s.write_all(&b)
}

/// The transmission flags of an export.
pub(crate) fn transmission_flags(info: &ExportInfo) -> u16 {
    let mut f = TFLAG_HAS_FLAGS;
    if info.read_only {
        f |= TFLAG_READ_ONLY;
    } else {
        if info.trim {
            f |= TFLAG_SEND_TRIM;
        }
        if info.write_zeroes {
            f |= TFLAG_SEND_WRITE_ZEROES;
        }
        if info.fua {
            f |= TFLAG_SEND_FUA;
        }
    }
    if info.flush {
        f |= TFLAG_SEND_FLUSH;
    }
    if info.multi_conn {
        f |= TFLAG_CAN_MULTI_CONN;
    }
    f
}

/// The largest READ or WRITE the server takes from this client: what NBD
/// clients use by default (32 MiB), unless the in-flight cap times the
/// backend's transfer size is smaller (a request's pieces must fit in flight
/// at once).
pub(crate) fn max_request(info: &ExportInfo, cap: usize) -> u32 {
    let by_cap = (info.max_transfer as u64).saturating_mul(cap as u64);
    by_cap.min(32 << 20) as u32
}

/// How many backend requests a connection keeps in flight.
pub(crate) fn in_flight_cap(info: &ExportInfo, cfg: &ServerConfig) -> usize {
    (info.queue_depth as usize).min(cfg.max_in_flight).max(1)
}

/// Runs the negotiation. `Ok(None)`: the client left (ABORT, EOF) or was
/// dropped for breaking the protocol.
pub(crate) fn negotiate<E: Export>(
    s: &mut Stream,
    export: &E,
    cfg: &ServerConfig,
) -> io::Result<Option<Opened<E>>> {
    let mut hello = [0u8; 18];
    hello[0..8].copy_from_slice(&NBD_MAGIC.to_be_bytes());
    hello[8..16].copy_from_slice(&IHAVEOPT.to_be_bytes());
    hello[16..18].copy_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
    s.write_all(&hello)?;

    let mut cf = [0u8; 4];
    s.read_exact(&mut cf)?;
    let client_flags = u32::from_be_bytes(cf);
    if client_flags & !(CLIENT_FIXED_NEWSTYLE | CLIENT_NO_ZEROES) != 0 {
        tracing::debug!(client_flags, "unknown client flags: closing");
        return Ok(None);
    }
    if client_flags & CLIENT_FIXED_NEWSTYLE == 0 {
        tracing::debug!("client does not speak fixed newstyle: closing");
        return Ok(None);
    }
    let no_zeroes = client_flags & CLIENT_NO_ZEROES != 0;
    let mut structured = false;
    let mut base_allocation = false;

    for _ in 0..MAX_OPTIONS {
        let mut h = [0u8; 16];
        s.read_exact(&mut h)?;
        if be64(&h[0..8]) != IHAVEOPT {
            tracing::debug!("bad option magic: closing");
            return Ok(None);
        }
        let option = be32(&h[8..12]);
        let len = be32(&h[12..16]);
        if len > MAX_OPTION_LEN {
            if option == OPT_EXPORT_NAME || len > MAX_SKIPPED_OPTION_LEN {
                tracing::debug!(option, len, "oversized option: closing");
                return Ok(None);
            }
            s.discard(len as u64)?;
            reply(s, option, REP_ERR_TOO_BIG, b"option too long")?;
            continue;
        }
        let mut data = vec![0u8; len as usize];
        s.read_exact(&mut data)?;

        match option {
            OPT_EXPORT_NAME => {
                if !names_export(cfg, &data) {
                    // This option has no error reply: closing is the answer.
                    tracing::debug!("EXPORT_NAME of an unknown export: closing");
                    return Ok(None);
                }
                let (info, submitter, completer) = match open(export) {
                    Ok(o) => o,
                    Err(e) => {
                        tracing::warn!("backend unavailable: {e}");
                        return Ok(None);
                    }
                };
                let mut b = Vec::with_capacity(10 + 124);
                b.extend_from_slice(&info.size.to_be_bytes());
                b.extend_from_slice(&transmission_flags(&info).to_be_bytes());
                if !no_zeroes {
                    b.resize(b.len() + 124, 0);
                }
                s.write_all(&b)?;
                return Ok(Some(Negotiated { info, submitter, completer, structured, base_allocation }));
            }
            OPT_ABORT => {
                let _ = reply(s, option, REP_ACK, &[]);
                return Ok(None);
            }
            OPT_LIST => {
                if !data.is_empty() {
                    reply(s, option, REP_ERR_INVALID, b"LIST takes no data")?;
                    continue;
                }
                let name = cfg.export_name.as_bytes();
                let mut b = Vec::with_capacity(4 + name.len());
                b.extend_from_slice(&(name.len() as u32).to_be_bytes());
                b.extend_from_slice(name);
                reply(s, option, REP_SERVER, &b)?;
                reply(s, option, REP_ACK, &[])?;
            }
            OPT_STRUCTURED_REPLY => {
                if !data.is_empty() {
                    reply(s, option, REP_ERR_INVALID, b"STRUCTURED_REPLY takes no data")?;
                    continue;
                }
                structured = true;
                reply(s, option, REP_ACK, &[])?;
            }
            OPT_INFO | OPT_GO => {
                let Some((name, requests)) = parse_info_request(&data) else {
                    reply(s, option, REP_ERR_INVALID, b"malformed INFO/GO request")?;
                    continue;
                };
                if !names_export(cfg, name) {
                    reply(s, option, REP_ERR_UNKNOWN, b"no such export")?;
                    continue;
                }
                let (info, submitter, completer) = match open(export) {
                    Ok(o) => o,
                    Err(e) => {
                        tracing::warn!("backend unavailable: {e}");
                        reply(s, option, REP_ERR_UNKNOWN, format!("export unavailable: {e}").as_bytes())?;
                        continue;
                    }
                };
                send_info(s, option, &info, cfg, &requests)?;
                reply(s, option, REP_ACK, &[])?;
                if option == OPT_GO {
                    return Ok(Some(Negotiated { info, submitter, completer, structured, base_allocation }));
                }
            }
            OPT_LIST_META_CONTEXT | OPT_SET_META_CONTEXT => {
                let set = option == OPT_SET_META_CONTEXT;
                if set && !structured {
                    reply(s, option, REP_ERR_INVALID, b"SET_META_CONTEXT needs structured replies")?;
                    continue;
                }
                let Some((name, queries)) = parse_meta_request(&data) else {
                    reply(s, option, REP_ERR_INVALID, b"malformed meta context request")?;
                    continue;
                };
                if !names_export(cfg, name) {
                    reply(s, option, REP_ERR_UNKNOWN, b"no such export")?;
                    continue;
                }
                let matched = if set {
                    queries.iter().any(|q| *q == BASE_ALLOCATION.as_bytes())
                } else {
                    queries.is_empty() || queries.iter().any(|q| *q == BASE_ALLOCATION.as_bytes() || *q == b"base:")
                };
                if set {
                    base_allocation = matched;
                }
                if matched {
                    let id = if set { BASE_ALLOCATION_ID } else { 0 };
                    let mut b = Vec::with_capacity(4 + BASE_ALLOCATION.len());
                    b.extend_from_slice(&id.to_be_bytes());
                    b.extend_from_slice(BASE_ALLOCATION.as_bytes());
                    reply(s, option, REP_META_CONTEXT, &b)?;
                }
                reply(s, option, REP_ACK, &[])?;
            }
            // STARTTLS, EXTENDED_HEADERS and anything newer or unknown.
            _ => {
                tracing::debug!(option, "unsupported option");
                reply(s, option, REP_ERR_UNSUP, b"option not supported")?;
            }
        }
    }
    tracing::debug!("too many options: closing");
    Ok(None)
}

fn open<E: Export>(export: &E) -> io::Result<(ExportInfo, E::Submitter, E::Completer)> {
    let (info, sub, comp) = export.open()?;
    info.validate().map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("backend reports {e}")))?;
    Ok((info, sub, comp))
}

/// The empty name is the default export; otherwise it must be ours.
fn names_export(cfg: &ServerConfig, name: &[u8]) -> bool {
    name.is_empty() || name == cfg.export_name.as_bytes()
}

/// INFO/GO data: u32 name length, name, u16 count, count × u16 info types.
fn parse_info_request(d: &[u8]) -> Option<(&[u8], Vec<u16>)> {
    let name_len = be32(d.get(0..4)?) as usize;
    let name = d.get(4..4usize.checked_add(name_len)?)?;
    let rest = &d[4 + name_len..];
    let count = be16(rest.get(0..2)?) as usize;
    let list = &rest[2..];
    if list.len() != count * 2 {
        return None;
    }
    Some((name, list.chunks_exact(2).map(be16).collect()))
}

/// Meta context data: u32 name length, name, u32 count, count × (u32 length, query).
fn parse_meta_request(d: &[u8]) -> Option<(&[u8], Vec<&[u8]>)> {
    let name_len = be32(d.get(0..4)?) as usize;
    let name = d.get(4..4usize.checked_add(name_len)?)?;
    let mut rest = &d[4 + name_len..];
    let count = be32(rest.get(0..4)?) as usize;
    rest = &rest[4..];
    // Each query takes at least 4 bytes: a count beyond that is a lie.
    if count > rest.len() / 4 {
        return None;
    }
    let mut queries = Vec::with_capacity(count);
    for _ in 0..count {
        let qlen = be32(rest.get(0..4)?) as usize;
        queries.push(rest.get(4..4usize.checked_add(qlen)?)?);
        rest = &rest[4 + qlen..];
    }
    if !rest.is_empty() {
        return None;
    }
    Some((name, queries))
}

fn send_info(s: &Stream, option: u32, info: &ExportInfo, cfg: &ServerConfig, requests: &[u16]) -> io::Result<()> {
    let mut b = Vec::with_capacity(12);
    b.extend_from_slice(&INFO_EXPORT.to_be_bytes());
    b.extend_from_slice(&info.size.to_be_bytes());
    b.extend_from_slice(&transmission_flags(info).to_be_bytes());
    reply(s, option, REP_INFO, &b)?;

    if requests.contains(&INFO_NAME) {
        let mut b = INFO_NAME.to_be_bytes().to_vec();
        b.extend_from_slice(cfg.export_name.as_bytes());
        reply(s, option, REP_INFO, &b)?;
    }
    if requests.contains(&INFO_DESCRIPTION) {
        if let Some(d) = &cfg.description {
            let mut b = INFO_DESCRIPTION.to_be_bytes().to_vec();
            b.extend_from_slice(d.as_bytes());
            reply(s, option, REP_INFO, &b)?;
        }
    }
    // Always sent: a client that did not ask and sends unaligned requests gets
    // EINVAL for them.
    let cap = in_flight_cap(info, cfg);
    let mut b = INFO_BLOCK_SIZE.to_be_bytes().to_vec();
    b.extend_from_slice(&info.block_size.to_be_bytes());
    let max = max_request(info, cap);
    let preferred = if info.block_size.max(4096) <= max { info.block_size.max(4096) } else { info.block_size };
    b.extend_from_slice(&preferred.to_be_bytes());
    b.extend_from_slice(&max.to_be_bytes());
    reply(s, option, REP_INFO, &b)
}
