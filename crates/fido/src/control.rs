//! The domain's line to the broker, on `fido-control`'s [`Session`]: this
//! module only chooses the carrier (the broker's Unix socket), turns the
//! session's errors into the library's, and keeps the calls the domain and
//! its channels make (`request`, `notify` …) in the library's terms.
//!
//! The session reconnects when the broker restarts and re-registers the domain
//! with everything it had (see `DomainInner`'s [`fido_control::Handler`]), so
//! established connections — which never touch the broker — go on unharmed.

use crate::error::{Error, InvalidArgument, Result};
use fido_control::{Backoff, ControlError, Handler, Joined, Options, Session, UnixConnector};
use fido_proto::{ErrorCode, RemoteError, Reply, Request};
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::{Arc, Weak};
use std::time::Duration;

/// How long requests wait (`None`: the session's defaults); see
/// [`crate::JoinOptions::request_timeout`] and [`crate::JoinOptions::link_wait`].
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Timeouts {
    pub(crate) request: Option<Duration>,
    pub(crate) link_wait: Option<Duration>,
}

pub(crate) struct Control {
    session: Session,
}

impl Control {
    /// Connects to the broker at `path` and sends `join` with the arena's
    /// descriptor. Nothing is read until [`start`](Control::start).
    pub(crate) fn join(path: PathBuf, join: Request, arena: OwnedFd, timeouts: Timeouts) -> Result<(Control, Joined)> {
        Self::join_through(Arc::new(UnixConnector::new(path)), join, vec![arena], timeouts)
    }

    /// Joins through any carrier: a VM guest's link to its supervisor,
    /// which attaches the VM's arena itself (`fds` is then empty).
    pub(crate) fn join_through(connector: Arc<dyn fido_control::Connect>, join: Request, fds: Vec<OwnedFd>, timeouts: Timeouts) -> Result<(Control, Joined)> {
        let defaults = Options::default();
        let options = Options {
            reconnect: Some(Backoff::default()),
            request_timeout: timeouts.request.unwrap_or(defaults.request_timeout),
            link_wait: timeouts.link_wait,
        };
        let (session, joined) = Session::join(connector, join, fds, options)?;
        Ok((Control { session }, joined))
    }

    /// Starts the control thread, which serves the domain until it is dropped.
    pub(crate) fn start(&self, domain: Weak<dyn Handler>, thread_name: String) -> Result<()> {
        Ok(self.session.start(domain, thread_name)?)
    }

    /// Whether the link to the broker is up now.
    pub(crate) fn connected(&self) -> bool {
        self.session.connected()
    }

    /// Whether the session ended for good (the broker refused to resume
    /// this domain, or it was stopped).
    pub(crate) fn ended(&self) -> bool {
        self.session.ended()
    }

    /// Successful reconnections after losing the broker.
    pub(crate) fn reconnects(&self) -> u64 {
        self.session.stats().reconnects
    }

    /// Sends a request and waits for its reply.
    pub(crate) fn request(&self, body: Request, fds: &[OwnedFd]) -> Result<(Reply, Vec<OwnedFd>)> {
        Ok(self.session.request(body, fds)?)
    }

    /// Sends a request without waiting for (or caring about) the reply.
    pub(crate) fn notify(&self, body: Request) {
        self.session.notify(body)
    }

    /// Sends a request with descriptors without waiting for the reply.
    pub(crate) fn notify_with(&self, body: Request, fds: &[OwnedFd]) -> Result<()> {
        Ok(self.session.notify_with(body, fds)?)
    }

    /// Sends Leave, waits up to `wait` for the answer, and stops.
    pub(crate) fn leave(&self, wait: Duration) -> Result<()> {
        Ok(self.session.leave(wait)?)
    }

    pub(crate) fn stop(&self) {
        self.session.stop()
    }
}

impl From<ControlError> for Error {
    fn from(e: ControlError) -> Error {
        match e {
            ControlError::Unavailable(why) => Error::BrokerUnavailable(why),
            ControlError::NoReply(after) => Error::BrokerUnavailable(format!("no reply from broker within {after:?}")),
            // A request cut off by the broker's death fails as the broker's
            // refusal with `Unavailable`: it may or may not have been done.
            ControlError::Lost(why) => Error::Broker(RemoteError::new(ErrorCode::Unavailable, why)),
            ControlError::Refused(remote) => Error::Broker(remote),
            ControlError::Protocol(p) => Error::broker_protocol(p),
            ControlError::Io(io) => Error::Io(io),
            e @ (ControlError::FdsNotSupported { .. }
            | ControlError::Encode(_)
            | ControlError::BadAddress(_)
            | ControlError::AlreadyTaken) => Error::Invalid(InvalidArgument::Request(e.to_string())),
        }
    }
}
