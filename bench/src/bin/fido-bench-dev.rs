//! Development driver for the `channel` baselines (the `fido` CLI does the same through
//! `fido bench channel`): `fido-bench-dev [--quick] [--json FILE] [--filter SUBSTR]`.
//! `fido-bench-dev __bench-peer ...` is a helper process.

use std::path::PathBuf;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(|s| s.as_str()) == Some("__bench-peer") {
        return fido_bench::peer_main(&args[1..]);
    }
    let mut opts = fido_bench::Opts::default();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--quick" => opts.quick = true,
            "--json" => {
                opts.json = Some(PathBuf::from(
                    it.next().ok_or_else(|| anyhow::anyhow!("--json FILE"))?,
                ))
            }
            "--filter" => {
                opts.filter = Some(
                    it.next()
                        .ok_or_else(|| anyhow::anyhow!("--filter SUBSTR"))?
                        .clone(),
                )
            }
            other => anyhow::bail!(
                "unknown argument {other}; usage: [--quick] [--json FILE] [--filter SUBSTR]"
            ),
        }
    }
    let t = std::time::Instant::now();
    let records = fido_bench::channel_baselines(&opts)?;
    fido_bench::print_table(&records);
    eprintln!(
        "({} records in {:.1} s)",
        records.len(),
        t.elapsed().as_secs_f64()
    );
    if let Some(p) = &opts.json {
        fido_bench::write_json(p, &records)?;
    }
    Ok(())
}
