//! Dispatch: a control message is decoded, checked (joined or not;
//! descriptors only where a request takes them) and routed to the handler of
//! its request family, whose answer becomes the reply.

use std::os::fd::OwnedFd;

use fido_proto::{ClientMsg, DomainId, ErrorCode, GoneReason, ProtoError, Request, StatusCursor};

use super::{err, Handled, Server};

impl Server {
    /// Handles one message from client `key`.
    pub(super) fn message(&mut self, key: u64, bytes: &[u8], fds: Vec<OwnedFd>, truncated: bool) {
        let decoded = if truncated {
            Err(ProtoError::Invalid(
                "message (data or descriptors truncated)",
            ))
        } else {
            fido_proto::decode::<ClientMsg>(bytes)
        };
        let msg = match decoded {
            Ok(m) => m,
            Err(e) => {
                drop(fds);
                return self.malformed(key, bytes, e);
            }
        };
        let (id, body) = match msg {
            ClientMsg::Heartbeat => {
                if !fds.is_empty() {
                    tracing::warn!("heartbeat carried descriptors; closed them");
                }
                return;
            }
            ClientMsg::Request { id, body } => (id, body),
        };
        let joined = self.clients.get(&key).and_then(|c| c.domain);
        let result = match (joined, body) {
            (
                None,
                Request::Join {
                    name,
                    label,
                    arena_len,
                    resume,
                },
            ) => self.join(key, name, label, arena_len, resume, fds),
            // Looking needs no PGVAS slot: `fido status` works however full
            // the window is.
            (None, body) if is_observation(&body) => self.observe(key, body, fds),
            (Some(d), Request::Join { .. }) => Err(err(
                ErrorCode::AlreadyJoined,
                format!("this socket already joined as domain {d}"),
            )),
            (None, _) => Err(err(
                ErrorCode::NotJoined,
                "the first request on a connection must be Join",
            )),
            (Some(d), body) => self.request(key, d, id, body, fds),
        };
        match result {
            Ok(Some((reply, fds))) => self.reply(key, id, Ok(reply), fds),
            Ok(None) => {}
            Err(e) => {
                tracing::debug!(domain = ?joined, error = %e, "request failed");
                self.reply(key, id, Err(e), Vec::new())
            }
        }
        // Events that must follow the reply (e.g. PeerGone for a resumed
        // connection whose peer did not come back).
        self.send_after_reply();
    }

    /// A message that does not decode: answered when its request id can be
    /// read, else (or for a foreign protocol version) the client is dropped.
    fn malformed(&mut self, key: u64, bytes: &[u8], e: ProtoError) {
        let pid = self.clients.get(&key).map(|c| c.pid);
        tracing::warn!(pid, error = %e, "malformed control message");
        match (peek_id(bytes), e) {
            (id, ProtoError::Version(v)) => {
                let msg = format!(
                    "protocol version {v} not supported; this broker speaks {}",
                    fido_proto::PROTOCOL_VERSION
                );
                self.reply(
                    key,
                    id.unwrap_or(0),
                    Err(err(ErrorCode::Version, msg)),
                    Vec::new(),
                );
                self.doom(key, GoneReason::Exited);
            }
            (Some(id), e) => {
                let msg = format!("malformed request: {e}");
                self.reply(key, id, Err(err(ErrorCode::BadRequest, msg)), Vec::new());
            }
            (None, _) => self.doom(key, GoneReason::Exited),
        }
    }

    /// A request that only looks, from a client that has not joined.
    fn observe(&mut self, key: u64, body: Request, fds: Vec<OwnedFd>) -> Handled {
        if !fds.is_empty() {
            return Err(err(
                ErrorCode::BadDescriptor,
                format!("this request carries no descriptors, got {}", fds.len()),
            ));
        }
        let viewer = self.client_viewer(key)?;
        match body {
            Request::Status => self.status_request(&viewer, StatusCursor::START),
            Request::StatusPage { cursor } => self.status_request(&viewer, cursor),
            body => self.registry_look(&viewer, body),
        }
    }

    /// A request of joined domain `dom`, routed by family.
    fn request(
        &mut self,
        key: u64,
        dom: DomainId,
        id: u64,
        body: Request,
        fds: Vec<OwnedFd>,
    ) -> Handled {
        if !takes_descriptors(&body) && !fds.is_empty() {
            return Err(err(
                ErrorCode::BadDescriptor,
                format!("this request carries no descriptors, got {}", fds.len()),
            ));
        }
        match body {
            Request::Join { .. } => unreachable!("handled by the caller"),
            Request::Leave => self.leave(key, id),
            Request::Counters { counters } => self.set_counters(dom, counters),
            body @ (Request::Offer { .. }
            | Request::Withdraw { .. }
            | Request::Connect { .. }
            | Request::Accept { .. }
            | Request::Refuse { .. }
            | Request::Close { .. }
            | Request::GrantSlot { .. }
            | Request::Unmapped { .. }) => self.connection_request(key, dom, id, body, fds),
            body @ (Request::Read { .. }
            | Request::List { .. }
            | Request::ListPage { .. }
            | Request::Write { .. }
            | Request::Delete { .. }
            | Request::Watch { .. }
            | Request::Unwatch { .. }
            | Request::Transaction { .. }) => self.registry_request(dom, body),
            Request::Status => self.status_request(&self.domain_viewer(dom)?, StatusCursor::START),
            Request::StatusPage { cursor } => {
                self.status_request(&self.domain_viewer(dom)?, cursor)
            }
            body @ (Request::PipeCreate
            | Request::PipeRun { .. }
            | Request::PipeOnce { .. }
            | Request::PipeCancel { .. }
            | Request::PipeDestroy { .. }
            | Request::PipeWeight { .. }) => self.pipe_request(key, dom, id, body, fds),
            body @ (Request::NetOffer { .. }
            | Request::NetWithdraw { .. }
            | Request::NetClaim
            | Request::NetListen
            | Request::NetUnlisten { .. }) => self.net_request(dom, body, fds),
        }
    }
}

/// Requests a client may make before (or without) joining: they only look,
/// as far as its uid may see.
fn is_observation(body: &Request) -> bool {
    matches!(
        body,
        Request::Status
            | Request::StatusPage { .. }
            | Request::Read { .. }
            | Request::List { .. }
            | Request::ListPage { .. }
    )
}

/// Connect and Accept carry doorbells, PipeCreate and PipeOnce the pipe's
/// ends, the MMNet requests sockets and segments (Join, handled apart, its
/// arena); on any other request descriptors are a mistake.
fn takes_descriptors(body: &Request) -> bool {
    matches!(
        body,
        Request::Connect { .. }
            | Request::Accept { .. }
            | Request::PipeCreate
            | Request::PipeOnce { .. }
            | Request::NetOffer { .. }
            | Request::NetClaim
            | Request::NetListen
    )
}

/// The request id of a malformed message, when its header and first bytes are intact.
fn peek_id(bytes: &[u8]) -> Option<u64> {
    if bytes.len() < 10 || bytes[0..2] != *b"FD" || bytes[8] != 0 {
        return None;
    }
    let mut id = 0u64;
    for (i, b) in bytes[9..].iter().take(10).enumerate() {
        id |= u64::from(b & 0x7f) << (7 * i);
        if b & 0x80 == 0 {
            return Some(id);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peek_id_recovers_request_ids() {
        let bytes = fido_proto::encode(&ClientMsg::Request {
            id: 300,
            body: Request::Status,
        })
        .unwrap();
        assert_eq!(peek_id(&bytes), Some(300));
        assert_eq!(
            peek_id(&fido_proto::encode(&ClientMsg::Heartbeat).unwrap()),
            None
        );
        assert_eq!(peek_id(b"garbage"), None);
        assert_eq!(peek_id(b"FD\x01\x00\x05\x00\x00\x00\x00\xff\xff"), None);
    }
}
