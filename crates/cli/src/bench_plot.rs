//! The PNG plot of a `remora bench launch|copy|startup` report. `launch|copy`: one panel per
//! metric, the number of clients across, one line per mode (native, shm, unix, tcp).
//! `startup`: bars per mode for each program (seconds, and remoted / native), and for the
//! whole run of all programs.

use std::path::Path;

use anyhow::{Context, Result, anyhow};
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

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

/// One panel of the plot.
#[derive(Debug, Clone, PartialEq)]
struct Panel {
    title: String,
    /// Each mode's value over native's (native is 1).
    relative: bool,
    /// The x axis, left to right: (label, metric, clients) of the figures drawn there.
    xs: Vec<(String, String, u32)>,
    /// Grouped bars, one per mode at each x (categories: programs), rather than lines across
    /// the x axis (client counts).
    bars: bool,
}

impl Panel {
    /// A panel with many bar groups takes a whole row of the plot, with its labels upright.
    fn wide(&self) -> bool {
        self.bars && self.xs.len() > 4
    }
}

/// The panels drawn, in order.
fn panels(r: &Report) -> Vec<Panel> {
    match r.benchmark.as_str() {
        "startup" => startup_panels(r),
        "fairness" => fairness_panels(),
        _ => client_panels(r),
    }
}

/// `bench fairness`: the greedy tenants' shares of the GPU in each scenario, and the latency
/// tenant's p50 and p99 alone and beside a greedy one; one bar per sharing mode.
fn fairness_panels() -> Vec<Panel> {
    let x =
        |label: &str, metric: &str, clients: u32| (label.to_owned(), metric.to_owned(), clients);
    vec![
        Panel {
            title: "greedy tenant's share of the GPU (1 = native alone)".into(),
            relative: false,
            xs: vec![
                x("alone", "greedy_alone.greedy.gpu_share", 1),
                x("beside latency", "with_greedy.greedy.gpu_share", 2),
                x("2 greedy: alice", "two_greedy.alice.gpu_share", 2),
                x("2 greedy: bob", "two_greedy.bob.gpu_share", 2),
            ],
            bars: true,
        },
        Panel {
            title: "latency tenant: launch + synchronize (us)".into(),
            relative: false,
            xs: vec![
                x("p50 alone", "latency_alone.latency.p50", 1),
                x("p50 beside greedy", "with_greedy.latency.p50", 2),
                x("p99 alone", "latency_alone.latency.p99", 1),
                x("p99 beside greedy", "with_greedy.latency.p99", 2),
            ],
            bars: true,
        },
    ]
}

/// `bench launch|copy`: one panel per metric, absolute and (with native) relative; the client
/// counts across.
fn client_panels(r: &Report) -> Vec<Panel> {
    let mut metrics: Vec<String> = Vec::new();
    for f in &r.figures {
        let shown = f.metric == "launch.per_launch"
            || f.metric == "launch_sync.p50"
            || f.metric == "mix.total"
            || f.metric.ends_with(".aggregate");
        if shown && !metrics.contains(&f.metric) {
            metrics.push(f.metric.clone());
        }
    }
    let mut clients: Vec<u32> = r.figures.iter().map(|f| f.clients).collect();
    clients.sort_unstable();
    clients.dedup();
    let has_native = r.figures.iter().any(|f| f.mode == "native");
    let mut out = Vec::new();
    for m in metrics {
        let unit = r
            .figures
            .iter()
            .find(|f| f.metric == m)
            .map_or(String::new(), |f| f.unit.clone());
        let title = match m.as_str() {
            "launch.per_launch" => format!("empty-kernel launch ({unit}, lower is better)"),
            "launch_sync.p50" => format!("launch + synchronize p50 ({unit}, lower is better)"),
            "mix.total" => format!("CUDA-program mix, one pass ({unit}, lower is better)"),
            other => format!(
                "{} ({unit}, all clients, higher is better)",
                other
                    .trim_start_matches("copy.")
                    .trim_end_matches(".aggregate")
            ),
        };
        let xs: Vec<(String, String, u32)> = clients
            .iter()
            .map(|c| (c.to_string(), m.clone(), *c))
            .collect();
        let relative = format!(
            "{}: remoted / native",
            title.split(" (").next().unwrap_or(&title)
        );
        out.push(Panel {
            title,
            relative: false,
            xs: xs.clone(),
            bars: false,
        });
        if has_native {
            out.push(Panel {
                title: relative,
                relative: true,
                xs,
                bars: false,
            });
        }
    }
    out
}

/// `bench startup`: each program's seconds, each program's (and the whole run's) ratio to
/// native, and the whole run's seconds; one bar per mode.
fn startup_panels(r: &Report) -> Vec<Panel> {
    let mut programs: Vec<(String, String, u32)> = Vec::new();
    for f in &r.figures {
        if let Some(name) = f.metric.strip_prefix("startup.")
            && !programs.iter().any(|p| p.1 == f.metric)
        {
            programs.push((name.to_owned(), f.metric.clone(), 1));
        }
    }
    let n = programs.len();
    // With one program the whole run is that program.
    let whole = (n > 1 && r.figures.iter().any(|f| f.metric == "whole_run.total"))
        .then(|| (format!("all {n}"), "whole_run.total".to_owned(), 1));
    let has_native = r.figures.iter().any(|f| f.mode == "native");
    let mut out = Vec::new();
    if n > 0 {
        out.push(Panel {
            title: "whole run of each program (s, lower is better)".into(),
            relative: false,
            xs: programs.clone(),
            bars: true,
        });
    }
    if has_native && (n > 0 || whole.is_some()) {
        out.push(Panel {
            title: "each program: remoted / native".into(),
            relative: true,
            xs: programs.into_iter().chain(whole.clone()).collect(),
            bars: true,
        });
    }
    if let Some((_, metric, clients)) = whole {
        out.push(Panel {
            title: format!("whole run of {n} programs (s, lower is better)"),
            relative: false,
            xs: vec![(format!("{n} programs"), metric, clients)],
            bars: true,
        });
    }
    out
}

/// The plot's rows: a wide panel alone, others two to a row.
fn rows(panels: &[Panel]) -> Vec<Vec<usize>> {
    let mut rows: Vec<Vec<usize>> = Vec::new();
    for (i, p) in panels.iter().enumerate() {
        match rows.last_mut() {
            Some(row) if !p.wide() && row.len() == 1 && !panels[row[0]].wide() => row.push(i),
            _ => rows.push(vec![i]),
        }
    }
    rows
}

/// Every other colour a mode may be given when its own is taken in a plot ([`colors`]).
const PALETTE: [RGBColor; 12] = [
    RGBColor(0, 114, 178),
    RGBColor(213, 94, 0),
    RGBColor(0, 158, 115),
    RGBColor(204, 121, 167),
    RGBColor(230, 159, 0),
    RGBColor(86, 180, 233),
    RGBColor(40, 40, 40),
    RGBColor(150, 60, 20),
    RGBColor(100, 100, 220),
    RGBColor(120, 160, 40),
    RGBColor(130, 130, 130),
    RGBColor(90, 30, 110),
];

/// The colours of `modes` in one plot: each mode's own ([`color`]), unless an earlier mode
/// of the plot has it, then the first colour of [`PALETTE`] no earlier mode has (two modes
/// of one plot never share a colour while the palette lasts).
fn colors(modes: &[&str]) -> Vec<RGBColor> {
    let mut taken: Vec<RGBColor> = Vec::with_capacity(modes.len());
    for mode in modes {
        let own = color(mode);
        let c = if taken.contains(&own) {
            PALETTE
                .iter()
                .copied()
                .find(|c| !taken.contains(c))
                .unwrap_or(own)
        } else {
            own
        };
        taken.push(c);
    }
    taken
}

fn color(mode: &str) -> RGBColor {
    match mode {
        "native" => RGBColor(40, 40, 40),
        "native-held" => RGBColor(130, 130, 130),
        "embedded-held-shm" => RGBColor(204, 121, 167),
        "embedded-held-unix" => RGBColor(120, 160, 40),
        "embedded-held-tcp" => RGBColor(150, 60, 20),
        "shm" | "standing-shm" => RGBColor(0, 114, 178),
        "unix" | "standing-unix" => RGBColor(0, 158, 115),
        "embedded-shm" => RGBColor(86, 180, 233),
        "embedded-unix" => RGBColor(120, 205, 160),
        "embedded-tcp" => RGBColor(230, 159, 0),
        "tcp" | "standing-tcp" => RGBColor(213, 94, 0),
        // Other modes (`bench contention`'s "shm spin burn=1x" and the like): a colour of
        // their own from a fixed palette, the same for the same name in every plot.
        other => {
            let h = other.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
                (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
            });
            PALETTE[(h % PALETTE.len() as u64) as usize]
        }
    }
}

/// Longest x label drawn, in characters (longer ones are cut).
const MAX_LABEL: usize = 28;

fn label_text(label: &str) -> String {
    if label.chars().count() > MAX_LABEL {
        let cut: String = label.chars().take(MAX_LABEL - 1).collect();
        format!("{cut}…")
    } else {
        label.to_owned()
    }
}

/// Writes the plot.
pub(crate) fn plot(r: &Report, path: &Path) -> Result<()> {
    register_font();
    let panels = panels(r);
    if panels.is_empty() {
        return Err(anyhow!("nothing to plot: the report has no figures"));
    }
    let mut modes: Vec<&str> = Vec::new();
    for f in &r.figures {
        if !modes.contains(&f.mode.as_str()) {
            modes.push(&f.mode);
        }
    }
    let palette = colors(&modes);
    let rows = rows(&panels);
    // Two columns, unless every panel is a narrow one alone.
    let cols: u32 = if rows.iter().any(|r| r.len() > 1 || panels[r[0]].wide()) {
        2
    } else {
        1
    };
    // A wide panel: room for a bar per mode in each group (up to a bound on the image's
    // size); its labels stand upright below.
    let wide_width = panels
        .iter()
        .filter(|p| p.wide())
        .map(|p| 100 + p.xs.len() as u32 * (modes.len() as u32 * 9 + 14))
        .max()
        .unwrap_or(0)
        .min(8000);
    let width = (560 * cols).max(wide_width);
    let label_room = |p: &Panel| -> u32 {
        let chars =
            p.xs.iter()
                .map(|x| label_text(&x.0).chars().count())
                .max()
                .unwrap_or(0);
        if p.wide() { chars as u32 * 8 + 12 } else { 30 }
    };
    let heights: Vec<u32> = rows
        .iter()
        .map(|row| {
            row.iter()
                .map(|&i| 350 + label_room(&panels[i]))
                .max()
                .unwrap_or(380)
        })
        .collect();
    let size = (width, heights.iter().sum::<u32>() + 40);
    let root = BitMapBackend::new(path, size).into_drawing_area();
    let err = |e: &dyn std::fmt::Display| anyhow!("cannot draw {}: {e}", path.display());
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let (title, body) = root.split_vertically(40);
    let device = if r.device.is_empty() { "?" } else { &r.device };
    let heading = if r.benchmark == "startup" {
        format!(
            "remora bench startup on {device} — median of {} round(s); each run a fresh process",
            r.rounds
        )
    } else {
        format!(
            "remora bench {} on {device} — median of {} round(s); x: concurrent clients",
            r.benchmark, r.rounds
        )
    };
    title
        .titled(&heading, ("sans-serif", 20))
        .map_err(|e| err(&e))?;
    let mut breaks = Vec::new();
    let mut y = 0;
    for h in &heights[..heights.len() - 1] {
        y += *h as i32;
        breaks.push(y);
    }
    let row_areas = body.split_by_breakpoints(Vec::<i32>::new(), breaks);
    for (row, row_area) in rows.iter().zip(row_areas) {
        let areas = if panels[row[0]].wide() {
            vec![row_area]
        } else {
            row_area.split_evenly((1, cols as usize))
        };
        for (&i, area) in row.iter().zip(areas) {
            draw_panel(
                r,
                &panels[i],
                &modes,
                &palette,
                &area,
                label_room(&panels[i]),
            )
            .map_err(|e| err(&e))?;
        }
    }
    root.present()
        .with_context(|| format!("cannot write {}", path.display()))?;
    Ok(())
}

type Area<'a> = DrawingArea<BitMapBackend<'a>, plotters::coord::Shift>;
type DrawResult<'a> =
    std::result::Result<(), DrawingAreaErrorKind<<BitMapBackend<'a> as DrawingBackend>::ErrorType>>;

/// Draws one panel into `area`.
fn draw_panel<'a>(
    r: &Report,
    panel: &Panel,
    modes: &[&str],
    palette: &[RGBColor],
    area: &Area<'a>,
    label_room: u32,
) -> DrawResult<'a> {
    // Each mode's (x index, y) points.
    let pts = |mode: &str| -> Vec<(usize, f64)> {
        panel
            .xs
            .iter()
            .enumerate()
            .filter_map(|(i, (_, metric, clients))| {
                let f = r
                    .figures
                    .iter()
                    .find(|f| f.mode == mode && &f.metric == metric && f.clients == *clients)?;
                let y = match (panel.relative, mode) {
                    (false, _) => f.value,
                    (true, "native") => 1.0,
                    (true, _) => f.ratio_to_native?,
                };
                y.is_finite().then_some((i, y))
            })
            .collect()
    };
    let top = modes
        .iter()
        .flat_map(|m| pts(m))
        .map(|p| p.1)
        .fold(0.0f64, f64::max)
        .max(1e-9);
    // Room above the data for the legend: a line per mode.
    let ymax = if panel.bars {
        let legend = (modes.len() as f64 * 17.0 + 20.0) / 300.0;
        top / (1.0 - legend.min(0.6))
    } else {
        top * 1.15
    };
    let n = panel.xs.len().max(1);
    let (lo, hi) = if panel.bars {
        (-0.5, n as f64 - 0.5)
    } else {
        (-0.3, n as f64 - 0.7)
    };
    let mut chart = ChartBuilder::on(area)
        .caption(&panel.title, ("sans-serif", 15))
        .margin(12)
        .x_label_area_size(label_room)
        .y_label_area_size(55)
        // With n labels asked for, plotters puts them at 0, 1, … n-1 on either range.
        .build_cartesian_2d(lo..hi, 0f64..ymax)?;
    let labels: Vec<String> = panel.xs.iter().map(|x| label_text(&x.0)).collect();
    chart
        .configure_mesh()
        .x_labels(n)
        .x_label_style(("sans-serif", 12))
        .x_label_formatter(&|x| {
            let i = x.round();
            match labels.get(i as usize) {
                // A wide panel's labels are drawn upright below.
                Some(l) if (x - i).abs() < 1e-6 && i >= 0.0 && !panel.wide() => l.clone(),
                _ => String::new(),
            }
        })
        .disable_x_mesh()
        .draw()?;
    if panel.wide() {
        // Read top to bottom, each starting just below its tick.
        let style = TextStyle::from(
            ("sans-serif", 12)
                .into_font()
                .transform(FontTransform::Rotate90),
        )
        .pos(Pos::new(HPos::Left, VPos::Center));
        let base = area.get_base_pixel();
        for (i, label) in labels.iter().enumerate() {
            let (x, y) = chart.backend_coord(&(i as f64, 0.0));
            area.draw_text(label, &style, (x - base.0, y - base.1 + 8))?;
        }
    }
    if panel.relative && panel.bars {
        chart.draw_series(LineSeries::new(
            [(lo, 1.0), (hi, 1.0)],
            RGBColor(150, 150, 150).stroke_width(1),
        ))?;
    }
    let width = 0.8 / modes.len().max(1) as f64;
    for (j, mode) in modes.iter().enumerate() {
        let p = pts(mode);
        if p.is_empty() {
            continue;
        }
        let c = palette[j];
        if panel.bars {
            let x0 = -0.4 + j as f64 * width;
            chart
                .draw_series(p.into_iter().map(|(i, y)| {
                    let x = i as f64 + x0;
                    Rectangle::new([(x, 0.0), (x + width * 0.9, y)], c.filled())
                }))?
                .label(*mode)
                .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], c.filled()));
        } else {
            let p: Vec<(f64, f64)> = p.into_iter().map(|(i, y)| (i as f64, y)).collect();
            chart
                .draw_series(LineSeries::new(p.clone(), c.stroke_width(2)))?
                .label(*mode)
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 16, y)], c.stroke_width(2))
                });
            chart.draw_series(p.into_iter().map(|xy| Circle::new(xy, 4, c.filled())))?;
        }
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 12))
        .position(if panel.bars {
            SeriesLabelPosition::UpperRight
        } else {
            SeriesLabelPosition::UpperLeft
        })
        .draw()?;
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
            workload: Some(crate::bench_gpu::Workload {
                launches: 1,
                syncs: 1,
                bytes: 0,
                reps: 1,
                ..Default::default()
            }),
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
        // Two metrics, each absolute and relative to native, two to a row.
        assert_eq!(panels(&r).len(), 4);
        assert_eq!(rows(&panels(&r)), [vec![0, 1], vec![2, 3]]);
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

    /// A `bench startup` report of `programs` programs in the usual seven modes.
    fn startup_report(programs: usize) -> Report {
        let modes = [
            "native",
            "embedded-shm",
            "embedded-unix",
            "embedded-tcp",
            "standing-shm",
            "standing-unix",
            "standing-tcp",
        ];
        let mut figures = Vec::new();
        let metrics = (0..programs)
            .map(|p| format!("startup.program_number_{p}_with_a_long_argument"))
            .chain(["whole_run.total".to_owned()]);
        for (p, metric) in metrics.enumerate() {
            for (m, mode) in modes.iter().enumerate() {
                let value = (0.2 + 0.01 * p as f64) * (1.0 + 0.25 * m as f64);
                figures.push(Figure {
                    mode: (*mode).into(),
                    clients: 1,
                    metric: metric.clone(),
                    unit: "s".into(),
                    value,
                    ratio_to_native: (m > 0).then_some(1.0 + 0.25 * m as f64),
                    ratio_to_raw_tcp: None,
                    rounds: vec![value],
                });
            }
        }
        Report {
            benchmark: "startup".into(),
            date_unix: 0,
            device: "GPU".into(),
            remora: "remora 0".into(),
            commit: String::new(),
            server: "embedded".into(),
            rounds: 3,
            workload: None,
            figures,
            notes: vec![],
        }
    }

    #[test]
    fn the_modes_of_one_plot_never_share_a_colour() {
        // standing-shm has shm's colour; the hashed colours of bench contention's modes
        // collide among a dozen names.
        let startup = [
            "native",
            "embedded-shm",
            "native-held",
            "embedded-held-shm",
            "standing-shm",
            "shm",
        ];
        let contention: Vec<String> = ["shm", "tcp"]
            .iter()
            .flat_map(|t| {
                ["spin", "block", "adaptive"]
                    .iter()
                    .flat_map(move |p| (1..=2).map(move |b| format!("{t} {p} burn={b}x")))
            })
            .collect();
        let contention: Vec<&str> = contention.iter().map(String::as_str).collect();
        for modes in [&startup[..], &contention[..]] {
            let c = colors(modes);
            assert_eq!(c.len(), modes.len());
            for i in 0..c.len() {
                for j in 0..i {
                    assert_ne!(c[i], c[j], "{} and {} share a colour", modes[i], modes[j]);
                }
            }
        }
        // A mode keeps its own colour when it is free.
        assert_eq!(colors(&["native", "shm"]), [color("native"), color("shm")]);
    }

    #[test]
    fn startup_reports_draw_bars_per_program_and_for_the_whole_run() {
        let r = startup_report(25);
        let p = panels(&r);
        let titles: Vec<&str> = p.iter().map(|p| p.title.as_str()).collect();
        assert_eq!(
            titles,
            [
                "whole run of each program (s, lower is better)",
                "each program: remoted / native",
                "whole run of 25 programs (s, lower is better)"
            ]
        );
        assert!(p.iter().all(|p| p.bars));
        assert_eq!(p[0].xs.len(), 25);
        assert_eq!(p[0].xs[0].0, "program_number_0_with_a_long_argument");
        // The ratio panel ends with the whole run.
        assert_eq!(p[1].xs[25], ("all 25".into(), "whole_run.total".into(), 1));
        assert!(p[1].relative && !p[0].relative && !p[2].relative);
        // The per-program panels take a row each.
        assert_eq!(rows(&p), [vec![0], vec![1], vec![2]]);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("startup.png");
        plot(&r, &path).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "a PNG file");

        // One program: no whole-run panel (it is that program), two panels side by side.
        let r = startup_report(1);
        let p = panels(&r);
        assert_eq!(p.len(), 2);
        assert_eq!(p[1].xs.len(), 1);
        assert_eq!(rows(&p), [vec![0, 1]]);
        plot(&r, &path).unwrap();
    }
}
