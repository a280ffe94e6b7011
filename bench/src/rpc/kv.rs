//! placeholder
use crate::harness::PeerArgs;
pub fn serve_tonic(_addr: &str) -> anyhow::Result<()> { anyhow::bail!("todo") }
pub fn client_main(_a: &PeerArgs) -> anyhow::Result<()> { anyhow::bail!("todo") }
