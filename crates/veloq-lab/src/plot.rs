//! Figures for results (PNG through plotters). Text is drawn with a TrueType font read at run time
//! (the one `use_font` names, else DejaVu Sans from the system), so no font is compiled into the
//! binary.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use anyhow::{anyhow, Context, Result};
use plotters::prelude::*;
use plotters::style::FontStyle;

use crate::eval::MethodScore;

/// llama.cpp's quantized caches on the same model and text (../shared/ANCHORS.md, measured in
/// another run): (ctx, label, bits/elem, ΔPPL, KL).
pub const LLAMA_CPP: &[(usize, &str, f64, f64, f64)] = &[
    (512, "q4_0", 4.5, 1.34, 0.058),
    (512, "q8_0", 8.5, -0.004, 0.0039),
    (512, "K q8_0 V q4_0", 6.5, 0.09, 0.0092),
    (2048, "q4_0", 4.5, 1.12, 0.052),
    (2048, "q8_0", 8.5, -0.011, 0.0038),
];

static FONT: OnceLock<PathBuf> = OnceLock::new();

/// The TrueType font figures are drawn with, chosen before the first figure (later calls and
/// calls after a figure are ignored: plotters registers a font once per process).
pub fn use_font(path: PathBuf) {
    let _ = FONT.set(path);
}

fn font() -> Result<()> {
    static LOADED: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    LOADED
        .get_or_init(|| {
            let path =
                FONT.get_or_init(|| "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf".into()).display().to_string();
            let bytes = std::fs::read(&path)
                .map_err(|e| format!("font {path}: {e} (install fonts-dejavu-core or pass --font)"))?;
            plotters::style::register_font("sans-serif", FontStyle::Normal, Box::leak(bytes.into_boxed_slice()))
                .map_err(|_| format!("font {path} is not a TrueType font"))
        })
        .clone()
        .map_err(|e| anyhow!(e))
}

/// The figures' legend: a white box with a black border at `at`.
fn legend<'a, DB, CT>(chart: &mut ChartContext<'a, DB, CT>, at: SeriesLabelPosition) -> Result<()>
where
    DB: DrawingBackend + 'a,
    DB::ErrorType: 'static,
    CT: CoordTranslate,
{
    chart.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).position(at).draw()?;
    Ok(())
}

/// Method family for the figure: `vq-2` → `vq`; ablations (`vq-2/no-rotate`) stay single points.
fn family(label: &str) -> (&str, bool) {
    (label.split('-').next().unwrap_or(label), label.contains('/') || label.starts_with("vq-k"))
}

const COLORS: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(255, 127, 14),
    RGBColor(140, 86, 75),
    RGBColor(30, 30, 30),
    RGBColor(188, 189, 34),
];

/// ΔPPL (left) and KL (right) against the coded stream's bits per element (the rate at long
/// context; tables shared by all positions are in the eval table, not on this axis), log scale, one
/// line per method family, ablations as crosses, llama.cpp's anchors as black triangles. ΔPPL
/// below 0.001 (including negative) is drawn at 0.001.
pub fn quality(path: &Path, ctx: usize, scores: &[MethodScore]) -> Result<()> {
    font()?;
    let root = BitMapBackend::new(path, (1400, 560)).into_drawing_area();
    root.fill(&WHITE)?;
    let root =
        root.titled(&format!("SmolLM2-135M, ctx {ctx}: quality vs stored bits per element"), ("sans-serif", 22))?;
    let panels = root.split_evenly((1, 2));
    let reference = scores[0].ppl();
    let floor = 1e-3;
    let metrics: [Metric; 2] = [
        ("ΔPPL vs fp16", Box::new(move |s: &MethodScore| s.ppl() - reference), 3),
        ("KL from fp16 (nats)", Box::new(|s: &MethodScore| s.kl()), 4),
    ];
    for (panel, (name, metric, anchor_col)) in panels.iter().zip(metrics) {
        let pts: Vec<(f64, f64)> = scores[1..].iter().map(|s| (s.stream_bits, metric(s).max(floor))).collect();
        let ymax = pts.iter().map(|p| p.1).fold(1.0, f64::max) * 2.0;
        let mut chart = ChartBuilder::on(panel)
            .margin(16)
            .caption(name, ("sans-serif", 18))
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(0.5f64..9.0, (floor..ymax).log_scale())?;
        chart
            .configure_mesh()
            .x_desc("bits per element of the coded stream (codes + per-group scales; shared codebooks excluded)")
            .y_desc(name)
            .draw()?;
        let mut families: Vec<&str> = Vec::new();
        for s in &scores[1..] {
            let (f, _) = family(&s.label);
            if !families.contains(&f) {
                families.push(f);
            }
        }
        for (i, f) in families.iter().enumerate() {
            let color = COLORS[i % COLORS.len()];
            let mut line: Vec<(f64, f64)> = scores[1..]
                .iter()
                .filter(|s| family(&s.label) == (*f, false))
                .map(|s| (s.stream_bits, metric(s).max(floor)))
                .collect();
            line.sort_by(|a, b| a.0.total_cmp(&b.0));
            chart
                .draw_series(LineSeries::new(line.clone(), color.stroke_width(2)).point_size(4))?
                .label(*f)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2)));
            chart.draw_series(line.iter().map(|&p| Circle::new(p, 4, color.filled())))?;
            for s in scores[1..].iter().filter(|s| family(&s.label) == (*f, true)) {
                let p = (s.stream_bits, metric(s).max(floor));
                chart.draw_series([Cross::new(p, 6, color.stroke_width(2))])?;
                let name = s.label.split_once('/').map_or(&s.label[3..], |(_, a)| a).to_string();
                chart.draw_series([Text::new(name, (p.0 + 0.1, p.1), ("sans-serif", 12))])?;
            }
        }
        let anchors: Vec<_> = LLAMA_CPP.iter().filter(|a| a.0 == ctx).collect();
        if !anchors.is_empty() {
            chart
                .draw_series(anchors.iter().map(|a| {
                    let y = if anchor_col == 3 { a.3 } else { a.4 };
                    EmptyElement::at((a.2, y.max(floor))) + TriangleMarker::new((0, 0), 6, BLACK.filled())
                }))?
                .label("llama.cpp (ANCHORS.md)")
                .legend(|(x, y)| TriangleMarker::new((x + 9, y), 5, BLACK.filled()));
            for a in anchors {
                let y = if anchor_col == 3 { a.3 } else { a.4 };
                chart.draw_series([Text::new(a.1.to_string(), (a.2 + 0.1, y.max(floor)), ("sans-serif", 12))])?;
            }
        }
        legend(&mut chart, SeriesLabelPosition::UpperRight)?;
    }
    root.present().with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

/// A panel of the quality figure: its title, what it plots per method, the anchor table's column.
type Metric<'a> = (&'a str, Box<dyn Fn(&MethodScore) -> f64>, usize);

/// One batch size's decode attention: (batch, veloq's (context, ms), SDPA's (context, ms)).
pub type AttentionSeries = (usize, Vec<(f64, f64)>, Vec<(f64, f64)>);

/// Decode attention time against context, log–log, per batch size: veloq over 2-bit codes (solid)
/// and SDPA over fp16 (dashed), measured in one device call.
#[allow(dead_code)]
pub fn attention(path: &Path, series: &[AttentionSeries]) -> Result<()> {
    font()?;
    let root = BitMapBackend::new(path, (900, 600)).into_drawing_area();
    root.fill(&WHITE)?;
    let all = series.iter().flat_map(|s| s.1.iter().chain(&s.2));
    let (mut xmin, mut xmax, mut ymin, mut ymax) = (f64::INFINITY, 0.0f64, f64::INFINITY, 0.0f64);
    for &(x, y) in all {
        (xmin, xmax, ymin, ymax) = (xmin.min(x), xmax.max(x), ymin.min(y), ymax.max(y));
    }
    let mut chart = ChartBuilder::on(&root)
        .margin(16)
        .caption("Decode attention, Llama-3.1-8B geometry (32 q / 8 kv heads, D 128), H200", ("sans-serif", 20))
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d((xmin * 0.8..xmax * 1.25).log_scale(), (ymin * 0.7..ymax * 1.5).log_scale())?;
    chart.configure_mesh().x_desc("context (tokens)").y_desc("ms per layer-step").draw()?;
    for (i, (b, ours, sdpa)) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        chart
            .draw_series(LineSeries::new(ours.clone(), color.stroke_width(2)))?
            .label(format!("veloq 2-bit codes, batch {b}"))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2)));
        chart.draw_series(ours.iter().map(|&p| Circle::new(p, 4, color.filled())))?;
        let dashed: Vec<_> = sdpa.clone();
        chart
            .draw_series(DashedLineSeries::new(dashed, 6, 4, color.stroke_width(1)))?
            .label(format!("SDPA fp16, batch {b}"))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(1)));
    }
    legend(&mut chart, SeriesLabelPosition::UpperLeft)?;
    root.present().with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

/// Panels of a figure: a title, then one labelled line of (x, y) points per method.
pub type Panels = Vec<(String, Vec<(String, Vec<(f64, f64)>)>)>;

/// The distinct x of every line, ascending.
fn measured_x(lines: &[(String, Vec<(f64, f64)>)]) -> Vec<f64> {
    let mut xs: Vec<f64> = lines.iter().flat_map(|l| l.1.iter().map(|p| p.0)).collect();
    xs.sort_by(f64::total_cmp);
    xs.dedup();
    xs
}

/// Tokens/s (`y_desc` says which) against context (log x), one line per method, one panel per
/// (model, batch) or (engine, threads).
pub fn speed(path: &Path, device: &str, x_desc: &str, y_desc: &str, panels: &Panels) -> Result<()> {
    font()?;
    let cols = panels.len().clamp(1, 2);
    let rows = panels.len().div_ceil(cols).max(1);
    let root = BitMapBackend::new(path, (560 * cols as u32, 420 * rows as u32)).into_drawing_area();
    root.fill(&WHITE)?;
    for ((title, lines), area) in panels.iter().zip(root.split_evenly((rows, cols))) {
        let xs = measured_x(lines);
        let (Some(&xmin), Some(&xmax)) = (xs.first(), xs.last()) else { continue };
        let ymax = lines.iter().flat_map(|l| l.1.iter()).map(|p| p.1).fold(0.0, f64::max);
        if !xmin.is_finite() || xmax <= 0.0 {
            continue;
        }
        let mut chart = ChartBuilder::on(&area)
            .margin(12)
            .caption(format!("{title} — {device}"), ("sans-serif", 15))
            .x_label_area_size(36)
            .y_label_area_size(56)
            .build_cartesian_2d((xmin * 0.8..xmax * 1.25).log_scale().with_key_points(xs), 0.0..ymax * 1.15)?;
        // Ticks at the measured x only: a log axis's own minor ticks crowd into overlapping labels.
        chart.configure_mesh().x_desc(x_desc).y_desc(y_desc).x_label_formatter(&|x| format!("{x}")).draw()?;
        for (i, (label, line)) in lines.iter().enumerate() {
            let color = COLORS[i % COLORS.len()];
            chart
                .draw_series(LineSeries::new(line.clone(), color.stroke_width(2)))?
                .label(label.clone())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2)));
            chart.draw_series(line.iter().map(|&p| Circle::new(p, 4, color.filled())))?;
        }
        legend(&mut chart, SeriesLabelPosition::UpperRight)?;
    }
    root.present().with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

/// One heatmap panel: a title and, per (depth row, length column), correct answers of all.
pub struct Heat {
    /// Panel title.
    pub title: String,
    /// Per (depth row, length column): correct answers, questions asked.
    pub cells: Vec<Vec<(usize, usize)>>,
}

/// Needle retrieval heatmaps, one panel per (method, haystack): rows are needle depths (top =
/// start of the context), columns context lengths, colour the share of keys returned exactly
/// (red 0 → green 1), each cell labelled correct/asked.
pub fn heatmap(path: &Path, lengths: &[usize], depths: &[f64], panels: &[Heat]) -> Result<()> {
    font()?;
    let cols = panels.len().clamp(1, 3);
    let rows = panels.len().div_ceil(cols).max(1);
    let root = BitMapBackend::new(path, (420 * cols as u32, 380 * rows as u32)).into_drawing_area();
    root.fill(&WHITE)?;
    let (nx, ny) = (lengths.len(), depths.len());
    for (panel, area) in panels.iter().zip(root.split_evenly((rows, cols))) {
        let mut chart = ChartBuilder::on(&area)
            .margin(10)
            .caption(&panel.title, ("sans-serif", 15))
            .x_label_area_size(34)
            .y_label_area_size(44)
            // Cells centred on whole coordinates, so the axis labels sit on them.
            .build_cartesian_2d(-0.5..nx as f64 - 0.5, -0.5..ny as f64 - 0.5)?;
        chart
            .configure_mesh()
            .disable_mesh()
            .x_labels(nx + 1)
            .y_labels(ny + 1)
            .x_label_formatter(&|x| {
                let i = x.floor() as usize;
                if (x - i as f64 - 0.0).abs() < 1e-9 && i < nx {
                    format!("{}", lengths[i])
                } else {
                    String::new()
                }
            })
            .y_label_formatter(&|y| {
                let i = y.floor() as usize;
                if i < ny && (y - i as f64).abs() < 1e-9 {
                    format!("{:.0}%", 100.0 * depths[ny - 1 - i])
                } else {
                    String::new()
                }
            })
            .x_desc("context (tokens)")
            .y_desc("needle depth")
            .draw()?;
        for (r, row) in panel.cells.iter().enumerate() {
            for (c, &(k, n)) in row.iter().enumerate() {
                let share = if n == 0 { 0.0 } else { k as f64 / n as f64 };
                let color = RGBColor((220.0 * (1.0 - share)) as u8 + 20, (180.0 * share) as u8 + 40, 60);
                let (x, y) = (c as f64, (ny - 1 - r) as f64);
                chart.draw_series(std::iter::once(Rectangle::new(
                    [(x - 0.5, y - 0.5), (x + 0.5, y + 0.5)],
                    color.filled(),
                )))?;
                chart.draw_series(std::iter::once(Text::new(
                    format!("{k}/{n}"),
                    (x - 0.12, y + 0.12),
                    ("sans-serif", 13).into_font().color(&WHITE),
                )))?;
            }
        }
    }
    root.present().with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

/// One panel of stacked bars: a title and, per bar, its label, its parts' values (in the order of
/// the figure's part names, bottom first) and a reference level drawn as a black tick.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // drawn by `bench runner` (CUDA builds)
pub struct Stacks {
    /// Panel title.
    pub title: String,
    /// Per bar: label, stacked values, and a reference line.
    pub bars: Vec<(String, Vec<f64>, Option<f64>)>,
}

/// Stacked bars, one panel per [`Stacks`]: what each bar's total is made of (`parts` names the
/// layers, bottom first) beside its reference level (the bytes floor of a decode step).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub fn stacked(path: &Path, device: &str, y_desc: &str, parts: &[&str], panels: &[Stacks]) -> Result<()> {
    font()?;
    let cols = panels.len().clamp(1, 2);
    let rows = panels.len().div_ceil(cols).max(1);
    let root = BitMapBackend::new(path, (640 * cols as u32, 440 * rows as u32)).into_drawing_area();
    root.fill(&WHITE)?;
    for (panel, area) in panels.iter().zip(root.split_evenly((rows, cols))) {
        let n = panel.bars.len();
        let top = |b: &(String, Vec<f64>, Option<f64>)| b.1.iter().sum::<f64>().max(b.2.unwrap_or(0.0));
        let ymax = panel.bars.iter().map(top).fold(0.0, f64::max);
        if n == 0 || ymax <= 0.0 {
            continue;
        }
        let labels: Vec<&str> = panel.bars.iter().map(|b| b.0.as_str()).collect();
        let mut chart = ChartBuilder::on(&area)
            .margin(12)
            .caption(format!("{} — {device}", panel.title), ("sans-serif", 15))
            .x_label_area_size(36)
            .y_label_area_size(56)
            .build_cartesian_2d(-0.5..n as f64 - 0.5, 0.0..ymax * 1.35)?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(n + 1)
            .x_label_formatter(&|x| {
                let i = x.round() as usize;
                if (x - i as f64).abs() < 1e-9 && i < n {
                    labels[i].to_string()
                } else {
                    String::new()
                }
            })
            .y_desc(y_desc)
            .draw()?;
        for (p, name) in parts.iter().enumerate() {
            let color = COLORS[p % COLORS.len()];
            let rects = panel.bars.iter().enumerate().map(|(i, b)| {
                let below: f64 = b.1[..p].iter().sum();
                let x = i as f64;
                Rectangle::new(
                    [(x - 0.35, below), (x + 0.35, below + b.1.get(p).copied().unwrap_or(0.0))],
                    color.filled(),
                )
            });
            chart
                .draw_series(rects)?
                .label(*name)
                .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], color.filled()));
        }
        let ticks = panel.bars.iter().enumerate().filter_map(|(i, b)| {
            let x = i as f64;
            b.2.map(|f| PathElement::new(vec![(x - 0.45, f), (x + 0.45, f)], BLACK.stroke_width(3)))
        });
        chart
            .draw_series(ticks)?
            .label("bytes floor")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 14, y)], BLACK.stroke_width(3)));
        legend(&mut chart, SeriesLabelPosition::UpperLeft)?;
    }
    root.present().with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}
