//! The PNG of `fido-bench rpc --plot FILE`: throughput against LEN (log–log), one
//! panel per sequence type and direction (the paper's Fig. 3 layout), one line per
//! system. Drawn with plotters' bitmap backend and an embedded DejaVu Sans font
//! (the `dejavu` crate), so it needs no system fonts and no display.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{anyhow, Context as _};
use plotters::prelude::*;
use plotters::style::FontStyle;

use super::{Case, Dir, Seq};
use crate::harness::Record;

const COLORS: [RGBColor; 8] = [
    RGBColor(214, 39, 40),  // fido: red
    RGBColor(31, 119, 180), // blue
    RGBColor(44, 160, 44),  // green
    RGBColor(255, 127, 14), // orange
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(127, 127, 127),
    RGBColor(23, 190, 207),
];

/// A fixed color per known system, so figures from different runs compare.
fn color_of(system: &str, i: usize) -> RGBColor {
    const KNOWN: [&str; 7] = [
        "fido",
        "uds",
        "tarpc",
        "capnp",
        "tonic",
        "xmlrpc",
        super::SHM_FLOOR, // grey
    ];
    match KNOWN.iter().position(|k| *k == system) {
        Some(p) => COLORS[p],
        None => COLORS[(KNOWN.len() + i) % COLORS.len()],
    }
}

fn register_font() -> anyhow::Result<()> {
    static DONE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let ok = *DONE.get_or_init(|| {
        plotters::style::register_font("sans-serif", FontStyle::Normal, dejavu::sans::regular())
            .is_ok()
            && plotters::style::register_font("sans-serif", FontStyle::Bold, dejavu::sans::bold())
                .is_ok()
    });
    if ok {
        Ok(())
    } else {
        Err(anyhow!("the embedded DejaVu font did not load"))
    }
}

/// One panel's lines: system -> [(LEN, MB/s)].
type Lines = BTreeMap<String, Vec<(f64, f64)>>;

/// Draws every `bytes_per_s` record of the sequence cases into `path` (PNG).
/// Systems appear in the order of their first record. Points that did not finish
/// are absent (a line stops where its system ran out of budget).
pub fn draw(records: &[Record], path: &Path, title: &str) -> anyhow::Result<()> {
    register_font()?;
    // (seq, dir) -> system -> [(len, MB/s)]
    let mut systems: Vec<String> = Vec::new();
    let mut panels: BTreeMap<(usize, usize), Lines> = BTreeMap::new();
    let (mut lo, mut hi) = (f64::MAX, f64::MIN);
    let (mut xlo, mut xhi) = (f64::MAX, f64::MIN);
    for r in records {
        let Ok(Case::Seq { seq, dir, len }) = Case::parse(&r.case) else {
            continue;
        };
        if r.metric != "bytes_per_s" || r.value <= 0.0 {
            continue;
        }
        if !systems.contains(&r.system) {
            systems.push(r.system.clone());
        }
        let col = Seq::ALL.iter().position(|s| *s == seq).unwrap();
        let row = if dir == Dir::Send { 0 } else { 1 };
        let mbs = r.value / 1e6;
        lo = lo.min(mbs);
        hi = hi.max(mbs);
        xlo = xlo.min(len as f64);
        xhi = xhi.max(len as f64);
        panels
            .entry((row, col))
            .or_default()
            .entry(r.system.clone())
            .or_default()
            .push((len as f64, mbs));
    }
    if systems.is_empty() {
        anyhow::bail!("no throughput records to plot");
    }
    if xlo >= xhi {
        xlo /= 2.0;
        xhi *= 2.0;
    }
    let (lo, hi) = (lo / 2.0, hi * 2.0);

    let root = BitMapBackend::new(path, (1800, 1100)).into_drawing_area();
    root.fill(&WHITE)?;
    let (head, body) = root.split_vertically(60);
    head.draw(&Text::new(
        title.to_string(),
        (20, 15),
        ("sans-serif", 26).into_font().style(FontStyle::Bold),
    ))?;
    let cells = body.split_evenly((2, 3));
    for (i, area) in cells.iter().enumerate() {
        let (row, col) = (i / 3, i % 3);
        let seq = Seq::ALL[col];
        let dir = if row == 0 { Dir::Send } else { Dir::Recv };
        let mut chart = ChartBuilder::on(area)
            .caption(format!("{} {}", seq.name(), dir.name()), ("sans-serif", 22))
            .margin(12)
            .x_label_area_size(45)
            .y_label_area_size(75)
            .build_cartesian_2d((xlo..xhi).log_scale(), (lo..hi).log_scale())?;
        chart
            .configure_mesh()
            .x_desc("LEN")
            .y_desc("MB/s (payload)")
            .x_label_formatter(&|v| format!("1e{:.0}", v.log10()))
            .y_label_formatter(&|v| {
                if *v >= 1.0 {
                    format!("{v:.0}")
                } else {
                    format!("{v:.2}")
                }
            })
            .label_style(("sans-serif", 15))
            .axis_desc_style(("sans-serif", 16))
            .draw()?;
        let Some(lines) = panels.get(&(row, col)) else {
            continue;
        };
        for (si, sys) in systems.iter().enumerate() {
            let Some(pts) = lines.get(sys) else { continue };
            let mut pts = pts.clone();
            pts.sort_by(|a, b| a.0.total_cmp(&b.0));
            let color = color_of(sys, si);
            let width = if sys.starts_with("fido") { 3 } else { 2 };
            chart
                .draw_series(LineSeries::new(pts.clone(), color.stroke_width(width)))?
                .label(sys.clone())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(3))
                });
            chart.draw_series(pts.iter().map(|&p| Circle::new(p, 4, color.filled())))?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .label_font(("sans-serif", 15))
            .draw()?;
    }
    root.present()
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_a_png_headless() {
        let mut recs = Vec::new();
        for (si, sys) in ["fido", "uds", "tonic"].iter().enumerate() {
            for c in Case::all(true) {
                if let Case::Seq { len, .. } = c {
                    recs.push(Record::throughput(
                        "rpc",
                        &c.name(),
                        sys,
                        (len as f64).sqrt() * 1e6 / (si + 1) as f64,
                        3,
                    ));
                }
            }
        }
        let dir = std::env::temp_dir().join(format!("fido-rpc-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("t.png");
        draw(&recs, &p, "test").unwrap();
        let b = std::fs::read(&p).unwrap();
        assert_eq!(&b[..8], b"\x89PNG\r\n\x1a\n");
        assert!(
            b.len() > 10_000,
            "suspiciously small PNG: {} bytes",
            b.len()
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
