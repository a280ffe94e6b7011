//! The `fido` strategy of [`crate::pipe_move::Mover`]: the broker's pipe engine
//! moves the bytes. (Wired to crates/fido-pipe once it lands.)

use std::sync::Arc;

use crate::pipe_move::Mover;

pub fn mover() -> anyhow::Result<Arc<dyn Mover>> {
    anyhow::bail!("the fido pipe engine is not available in this build; use --strategy sendfile or readwrite")
}
