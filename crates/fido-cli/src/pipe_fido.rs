//! The `fido` strategy of [`crate::pipe_move::Mover`]: the broker's pipe engine
//! moves the bytes. (Wired to crates/fido-pipe once it lands.)

use std::path::Path;
use std::sync::Arc;

use crate::pipe_move::Mover;

/// Whether the engine can be used through the broker at `_broker`.
pub fn available(_broker: &Path) -> bool {
    false
}

pub fn mover() -> anyhow::Result<Arc<dyn Mover>> {
    anyhow::bail!("the fido pipe engine is not available in this build; use --strategy sendfile or readwrite")
}

/// A mover whose domain has pipe weight `w`.
pub fn mover_weighted(_w: u32) -> anyhow::Result<Arc<dyn Mover>> {
    mover()
}
