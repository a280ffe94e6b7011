//! placeholder
pub fn role_main(_a: &[String]) -> anyhow::Result<()> { anyhow::bail!("todo") }
