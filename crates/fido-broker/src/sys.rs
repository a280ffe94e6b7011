//! The broker's socket calls live in `fido_proto::wire`, shared with the client library.

pub(crate) use fido_proto::wire::*;
