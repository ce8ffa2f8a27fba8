//! The PNG plot of a `remora bench launch|copy` report: one panel per metric, the number of
//! clients across, one line per mode (native, shm, unix, tcp).

use std::path::Path;

use anyhow::{Context, Result, anyhow};
use plotters::prelude::*;

use crate::bench_gpu::Report;

/// DejaVu Sans Mono (Bitstream Vera licence, `assets/DejaVuSansMono.LICENSE`): plotters draws
/// text with it, so the plot needs no fonts installed on the machine.
static FONT: &[u8] = include_bytes!("../assets/DejaVuSansMono.ttf");

fn register_font() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // A font that does not parse only leaves the text out; the plot is still written.
        let _ = plotters::style::register_font("sans-serif", FontStyle::Normal, FONT);
    });
}

/// The metrics drawn, in panel order: (metric, title, relative). A relative panel draws each
/// mode's value over native's with the same clients (native is the line at 1).
fn panels(r: &Report) -> Vec<(String, String, bool)> {
    let mut metrics: Vec<String> = Vec::new();
    for f in &r.figures {
        let shown = f.metric == "launch.per_launch"
            || f.metric == "launch_sync.p50"
            || f.metric.ends_with(".aggregate");
        if shown && !metrics.contains(&f.metric) {
            metrics.push(f.metric.clone());
        }
    }
    let has_native = r.figures.iter().any(|f| f.mode == "native");
    let absolute: Vec<(String, String)> = metrics
        .into_iter()
        .map(|m| {
            let unit = r
                .figures
                .iter()
                .find(|f| f.metric == m)
                .map_or(String::new(), |f| f.unit.clone());
            let title = match m.as_str() {
                "launch.per_launch" => format!("empty-kernel launch ({unit}, lower is better)"),
                "launch_sync.p50" => format!("launch + synchronize p50 ({unit}, lower is better)"),
                other => format!(
                    "{} ({unit}, all clients, higher is better)",
                    other
                        .trim_start_matches("copy.")
                        .trim_end_matches(".aggregate")
                ),
            };
            (m, title)
        })
        .collect();
    let mut out: Vec<(String, String, bool)> = Vec::new();
    for (m, title) in absolute {
        let relative = format!(
            "{}: remoted / native",
            title.split(" (").next().unwrap_or(&title)
        );
        out.push((m.clone(), title, false));
        if has_native {
            out.push((m, relative, true));
        }
    }
    out
}

fn color(mode: &str) -> RGBColor {
    match mode {
        "native" => RGBColor(40, 40, 40),
        "shm" => RGBColor(0, 114, 178),
        "unix" => RGBColor(0, 158, 115),
        _ => RGBColor(213, 94, 0),
    }
}

/// Writes the plot.
pub(crate) fn plot(r: &Report, path: &Path) -> Result<()> {
    register_font();
    let panels = panels(r);
    if panels.is_empty() {
        return Err(anyhow!("nothing to plot: the report has no figures"));
    }
    let cols = if panels.len() > 1 { 2 } else { 1 };
    let rows = panels.len().div_ceil(cols);
    let size = (560 * cols as u32, 380 * rows as u32 + 40);
    let root = BitMapBackend::new(path, size).into_drawing_area();
    let err = |e: &dyn std::fmt::Display| anyhow!("cannot draw {}: {e}", path.display());
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let (title, body) = root.split_vertically(40);
    title
        .titled(
            &format!(
                "remora bench {} on {} — median of {} round(s); x: concurrent clients",
                r.benchmark,
                if r.device.is_empty() { "?" } else { &r.device },
                r.rounds
            ),
            ("sans-serif", 20),
        )
        .map_err(|e| err(&e))?;
    let mut clients: Vec<u32> = r.figures.iter().map(|f| f.clients).collect();
    clients.sort_unstable();
    clients.dedup();
    let mut modes: Vec<&str> = Vec::new();
    for f in &r.figures {
        if !modes.contains(&f.mode.as_str()) {
            modes.push(&f.mode);
        }
    }
    let areas = body.split_evenly((rows, cols));
    for ((metric, title, relative), area) in panels.iter().zip(areas) {
        let pts = |mode: &str| -> Vec<(f64, f64)> {
            r.figures
                .iter()
                .filter(|f| f.mode == mode && &f.metric == metric && f.value.is_finite())
                .filter_map(|f| {
                    let i = clients.iter().position(|c| *c == f.clients)?;
                    let y = match (relative, mode) {
                        (false, _) => f.value,
                        (true, "native") => 1.0,
                        (true, _) => f.ratio_to_native?,
                    };
                    Some((i as f64, y))
                })
                .collect()
        };
        let ymax = modes
            .iter()
            .flat_map(|m| pts(m))
            .map(|p| p.1)
            .fold(0.0f64, f64::max)
            .max(1e-9)
            * 1.15;
        let n = clients.len().max(1) as f64;
        let mut chart = ChartBuilder::on(&area)
            .caption(title, ("sans-serif", 15))
            .margin(12)
            .x_label_area_size(30)
            .y_label_area_size(55)
            .build_cartesian_2d(-0.3f64..(n - 0.7), 0f64..ymax)
            .map_err(|e| err(&e))?;
        let labels = clients.clone();
        chart
            .configure_mesh()
            .x_labels(clients.len())
            .x_label_formatter(&|x| {
                let i = x.round();
                if (x - i).abs() < 1e-6 && i >= 0.0 {
                    labels.get(i as usize).map_or(String::new(), u32::to_string)
                } else {
                    String::new()
                }
            })
            .disable_x_mesh()
            .draw()
            .map_err(|e| err(&e))?;
        for mode in &modes {
            let p = pts(mode);
            if p.is_empty() {
                continue;
            }
            let c = color(mode);
            chart
                .draw_series(LineSeries::new(p.clone(), c.stroke_width(2)))
                .map_err(|e| err(&e))?
                .label(*mode)
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 16, y)], c.stroke_width(2))
                });
            chart
                .draw_series(p.into_iter().map(|xy| Circle::new(xy, 4, c.filled())))
                .map_err(|e| err(&e))?;
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .label_font(("sans-serif", 12))
            .position(SeriesLabelPosition::UpperLeft)
            .draw()
            .map_err(|e| err(&e))?;
    }
    root.present()
        .with_context(|| format!("cannot write {}", path.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench_gpu::Figure;

    #[test]
    fn writes_a_png_with_one_panel_per_metric() {
        let fig = |mode: &str, clients, metric: &str, value| Figure {
            mode: mode.into(),
            clients,
            metric: metric.into(),
            unit: "us".into(),
            value,
            ratio_to_native: None,
            ratio_to_raw_tcp: None,
            rounds: vec![value],
        };
        let r = Report {
            benchmark: "launch".into(),
            date_unix: 0,
            device: "GPU".into(),
            remora: "remora 0".into(),
            commit: String::new(),
            server: "embedded".into(),
            rounds: 1,
            workload: crate::bench_gpu::Workload {
                launches: 1,
                syncs: 1,
                bytes: 0,
                reps: 1,
            },
            figures: vec![
                fig("native", 1, "launch.per_launch", 3.6),
                Figure {
                    ratio_to_native: Some(4.0 / 3.6),
                    ..fig("shm", 1, "launch.per_launch", 4.0)
                },
                fig("shm", 4, "launch.per_launch", 5.0),
                fig("tcp", 4, "launch_sync.p50", 30.0),
            ],
            notes: vec![],
        };
        // Two metrics, each absolute and relative to native.
        assert_eq!(panels(&r).len(), 4);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("plot.png");
        plot(&r, &path).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "a PNG file");
        assert!(
            bytes.len() > 2000,
            "something was drawn ({} bytes)",
            bytes.len()
        );
    }
}
