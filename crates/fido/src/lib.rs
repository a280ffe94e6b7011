//! The Fido client library.
//!
//! A process **joins** a broker and becomes a domain: it gets an id, a sealed
//! arena whose pages its peers may map read-only, and a slot in the Pseudo
//! Global Virtual Address Space so a pointer into its arena means the same thing
//! in every domain. It **offers** services and **connects** to others'; the
//! broker exchanges arena grants and doorbells once, and from then on messages
//! are 64-byte descriptors in rings that each side keeps in its own memory.
//! A received [`Msg`] is a read-only view of the sender's buffer, read
//! through [`PeerSlice`]s (the sender can still write it); [`Channel::forward`]
//! passes it on to the next domain with the same pointers (transitive
//! zero-copy) and the release travels back when the last hop is done.
//!
//! ```no_run
//! use fido::{Domain, JoinOptions};
//! let d = Domain::join(JoinOptions::new("producer"))?;
//! let ch = d.connect("sink")?;
//! let mut buf = d.alloc(5)?;
//! buf.copy_from_slice(b"hello");
//! ch.send(buf)?;
//! # Ok::<(), fido::Error>(())
//! ```
//!
//! This library must never write another domain's memory, never use a value
//! read from a peer (index, length, pointer, cookie) before checking it, and
//! never let one misbehaving peer affect any connection but its own. The broker
//! is on the control path only: no message ever passes through it.

#[cfg(feature = "tokio")]
mod asynch;
mod channel;
mod control;
mod domain;
mod local_domain;
mod platform;
mod error;
pub mod validate;

#[cfg(feature = "tokio")]
pub use asynch::AsyncChannel;
pub use channel::{Channel, Message, Msg, SendError, Undelivered};
pub use domain::{BrokerLink, Domain, JoinOptions, Listener, NetClaim, Watch, WatchEvent};
pub use error::{Error, InvalidArgument, ProtocolError, Result};
pub use fido_proto::{default_broker_path, Counters, DomainId, ErrorCode, PeerInfo, Status, TxnOp};
pub use fido_ring::{Descriptor, Segment, WaitStrategy, INLINE_BYTES, MAX_SEGMENTS};
pub use fido_shm::{AddressMode, Buf, GPtr, ModeRequest, PeerSlice, PeerSliceOf, READ_CHUNK};
