//! Property checked by the `proto_*` fuzz targets and by
//! crates/fido-proto/tests/corpus.rs (which includes this file with `#[path]`,
//! so it must depend on nothing but `std` and `fido_proto`).
//!
//! For any byte string: `decode` must not panic; when it accepts the input, the
//! message must re-encode, the re-encoding must decode to an equal message, be
//! canonical (encoding again gives the same bytes) and be no longer than the
//! input (postcard's encoding is minimal, so a longer one means the decoder
//! invented data).

use std::fmt::Debug;

use fido_proto::{decode, encode, Validate};
use serde::{de::DeserializeOwned, Serialize};

/// Returns whether `data` decoded. Panics when a property is violated.
pub fn round_trip<T>(data: &[u8]) -> bool
where
    T: DeserializeOwned + Serialize + Validate + PartialEq + Debug,
{
    let Ok(msg) = decode::<T>(data) else {
        return false;
    };
    let bytes = encode(&msg).unwrap_or_else(|e| panic!("decoded {msg:?} but re-encode failed: {e}"));
    assert!(
        bytes.len() <= data.len(),
        "re-encoding ({} bytes) longer than the accepted input ({} bytes): {msg:?}",
        bytes.len(),
        data.len()
    );
    let again = decode::<T>(&bytes)
        .unwrap_or_else(|e| panic!("re-encoded {msg:?} does not decode: {e}"));
    assert_eq!(msg, again, "round trip changed the message");
    let bytes2 = encode(&again).expect("second encode");
    assert_eq!(bytes, bytes2, "encoding is not canonical");
    true
}
