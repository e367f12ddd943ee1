//! The benchmark charts, drawn as SVG with `plotters` from the records of the results file:
//! time per variant, tpu7x memory beside the anchors of docs/kda.md, Benchmarks, and time and memory
//! against sequence length.

use kda_core::DType;
use plotters::prelude::*;

use crate::bench::{BenchRecord, Suite, Variant};

const SIZE: (u32, u32) = (880, 440);
const COLORS: [RGBColor; 10] = [
    RGBColor(0x44, 0x77, 0xaa),
    RGBColor(0xee, 0x66, 0x77),
    RGBColor(0x22, 0x88, 0x33),
    RGBColor(0xaa, 0xaa, 0xaa),
    RGBColor(0xcc, 0xbb, 0x44),
    RGBColor(0x66, 0xcc, 0xee),
    RGBColor(0xaa, 0x33, 0x77),
    RGBColor(0x33, 0x22, 0x88),
    RGBColor(0x88, 0x22, 0x55),
    RGBColor(0x99, 0x99, 0x33),
];

/// docs/kda.md, Benchmarks: tokamax's Pallas KDA (PR #1103) compiled ahead of time for tpu7x:2x2x1,
/// bf16, primary shape, the compiler's peak in MB: (saved state, remat) per program.
const TOKAMAX_MB: [(&str, f64, f64); 4] = [
    ("forward fixed", 27.3, 29.4),
    ("forward packed", 28.9, 28.9),
    ("fwd+VJP fixed", 76.6, 78.7),
    ("fwd+VJP packed", 101.2, 109.1),
];
/// docs/kda.md, Benchmarks: the seed PR's estimated peak on TPU v7x for its fused forward+VJP (fixed,
/// packed), bf16, primary shape.
const SEED_PR_MB: [f64; 2] = [64.0, 97.7];
/// docs/kda.md, Benchmarks: tokamax's Mosaic KDA (saved state) counted with the method of
/// `kda_tpu::aot::cycles` (libtpu 0.0.52), bf16, primary shape, in thousands of static cycles,
/// per group of [`TOKAMAX_MB`].
const TOKAMAX_KCYCLES: [f64; 4] = [86.7, 177.0, 186.0, 361.0];

type Chart = Result<String, String>;

/// The series' legend in the upper left, on a white box.
fn legend<'a, CT: plotters::coord::CoordTranslate>(
    chart: &mut ChartContext<'a, SVGBackend<'a>, CT>,
) -> Result<(), String> {
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .draw()
        .map_err(err)
}

fn err(e: impl std::fmt::Display) -> String {
    format!("chart: {e}")
}

/// Grouped bars: one group per label, one bar per series (`None`: no bar).
fn bars(title: &str, y_desc: &str, groups: &[String], series: &[(String, Vec<Option<f64>>)]) -> Chart {
    let top = series.iter().flat_map(|(_, v)| v.iter().flatten()).fold(0.0f64, |a, &b| a.max(b)) * 1.15;
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let n = groups.len() as f64;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(64)
            .build_cartesian_2d(0f64..n, 0f64..top.max(1e-9))
            .map_err(err)?;
        let labels = groups.to_vec();
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(groups.len() * 2 + 1)
            .x_label_formatter(&|x| {
                let i = (x - 0.5).round();
                if (x - 0.5 - i).abs() < 1e-6 && i >= 0.0 && (i as usize) < labels.len() {
                    labels[i as usize].clone()
                } else {
                    String::new()
                }
            })
            .y_desc(y_desc)
            .draw()
            .map_err(err)?;
        let width = 0.8 / series.len() as f64;
        for (s, (name, values)) in series.iter().enumerate() {
            let color = COLORS[s % COLORS.len()];
            let rects: Vec<Rectangle<(f64, f64)>> = values
                .iter()
                .enumerate()
                .filter_map(|(g, v)| v.map(|v| (g, v)))
                .map(|(g, v)| {
                    let x0 = g as f64 + 0.1 + s as f64 * width;
                    Rectangle::new([(x0, 0.0), (x0 + width * 0.9, v)], color.filled())
                })
                .collect();
            chart
                .draw_series(rects)
                .map_err(err)?
                .label(name.as_str())
                .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], color.filled()));
        }
        legend(&mut chart)?;
        root.present().map_err(err)?;
    }
    Ok(svg)
}

/// Lines against a numeric x (sequence length).
fn lines(title: &str, y_desc: &str, series: &[(String, Vec<(f64, f64)>)]) -> Chart {
    let xs = series.iter().flat_map(|(_, p)| p.iter().map(|q| q.0));
    let (x0, x1) = xs.fold((f64::MAX, 0.0f64), |(a, b), x| (a.min(x), b.max(x)));
    let top = series.iter().flat_map(|(_, p)| p.iter().map(|q| q.1)).fold(0.0f64, f64::max) * 1.15;
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(64)
            .build_cartesian_2d(x0.min(x1)..x1.max(x0 + 1.0), 0f64..top.max(1e-9))
            .map_err(err)?;
        chart
            .configure_mesh()
            .x_desc("sequence length T")
            .y_desc(y_desc)
            .x_label_formatter(&|x| format!("{x:.0}"))
            .draw()
            .map_err(err)?;
        for (s, (name, points)) in series.iter().enumerate() {
            let color = COLORS[s % COLORS.len()];
            chart
                .draw_series(LineSeries::new(points.iter().copied(), color.stroke_width(2)))
                .map_err(err)?
                .label(name.as_str())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 14, y)], color.stroke_width(2)));
            chart.draw_series(points.iter().map(|&p| Circle::new(p, 3, color.filled()))).map_err(err)?;
        }
        legend(&mut chart)?;
        root.present().map_err(err)?;
    }
    Ok(svg)
}

fn find<'a>(
    rs: &[&'a BenchRecord],
    suite: Suite,
    variant: Variant,
    dtype: DType,
    packed: bool,
) -> Option<&'a BenchRecord> {
    rs.iter()
        .copied()
        .find(|r| r.suite == suite && r.variant == variant && r.dtype == dtype && r.packed() == packed)
}

/// Median time per variant of the forward+VJP suites, fixed and packed, f32 and bf16.
fn variant_times(rs: &[&BenchRecord]) -> Option<Chart> {
    let combos = [(DType::F32, false), (DType::F32, true), (DType::BF16, false), (DType::BF16, true)];
    let suite = |packed| if packed { Suite::BackwardPacked } else { Suite::Backward };
    let groups: Vec<String> =
        combos.iter().map(|&(d, p)| format!("{d} {}", if p { "packed" } else { "fixed" })).collect();
    let series: Vec<(String, Vec<Option<f64>>)> =
        [Variant::Baseline, Variant::FusedSavedState, Variant::FusedRemat]
            .iter()
            .map(|&v| {
                let values = combos
                    .iter()
                    .map(|&(d, p)| find(rs, suite(p), v, d, p).map(BenchRecord::median_ms))
                    .collect();
                (v.name().to_string(), values)
            })
            .collect();
    if series.iter().all(|(_, v)| v.iter().all(Option::is_none)) {
        return None;
    }
    Some(bars("Forward+VJP on the CPU plugin, primary shape (median ms)", "median ms", &groups, &series))
}

/// This project's series of the tpu7x charts over the groups of [`TOKAMAX_MB`] (bf16, primary
/// shape): `figure` of each variant's record, fixed or packed.
fn our_series(
    rs: &[&BenchRecord],
    figure: impl Fn(&BenchRecord) -> Option<f64>,
) -> Vec<(String, Vec<Option<f64>>)> {
    let ours = |variant: Variant, packed: bool| {
        let suite = match (variant, packed) {
            (Variant::Forward | Variant::ForwardMosaic, _) => Suite::Forward,
            (_, false) => Suite::Backward,
            (_, true) => Suite::BackwardPacked,
        };
        find(rs, suite, variant, DType::BF16, packed).and_then(&figure)
    };
    let (fwd, mosaic, saved, remat, fused_mosaic) = (
        Variant::Forward,
        Variant::ForwardMosaic,
        Variant::FusedSavedState,
        Variant::FusedRemat,
        Variant::FusedMosaic,
    );
    vec![
        (
            "this project, saved state".to_string(),
            vec![ours(fwd, false), ours(fwd, true), ours(saved, false), ours(saved, true)],
        ),
        ("this project, remat".to_string(), vec![None, None, ours(remat, false), ours(remat, true)]),
        (
            "this project, Mosaic kernels".to_string(),
            vec![
                ours(mosaic, false),
                ours(mosaic, true),
                ours(fused_mosaic, false),
                ours(fused_mosaic, true),
            ],
        ),
    ]
}

/// tpu7x compiler peaks (bf16) of this project's programs beside the anchors of docs/kda.md.
fn tpu_memory(rs: &[&BenchRecord]) -> Option<Chart> {
    let mut series = our_series(rs, |r| r.tpu_peak().map(|b| b as f64 / 1e6));
    if series[0].1.iter().all(Option::is_none) {
        return None;
    }
    series.push(("tokamax Pallas, saved state".to_string(), TOKAMAX_MB.iter().map(|t| Some(t.1)).collect()));
    series.push((
        "seed PR (TPU v7x estimate)".to_string(),
        vec![None, None, Some(SEED_PR_MB[0]), Some(SEED_PR_MB[1])],
    ));
    let groups: Vec<String> = TOKAMAX_MB.iter().map(|(g, _, _)| g.to_string()).collect();
    Some(bars("tpu7x:2x2x1 compiler peak memory, bf16, primary shape (MB)", "peak MB", &groups, &series))
}

/// tpu7x static cycles of the programs beside tokamax's Mosaic kernels counted the same way.
fn tpu_cycles(rs: &[&BenchRecord]) -> Option<Chart> {
    let mut series = our_series(rs, |r| r.tpu_cycles().map(|c| c as f64 / 1e3));
    if series[0].1.iter().all(Option::is_none) {
        return None;
    }
    series.push((
        "tokamax Mosaic, saved state".to_string(),
        TOKAMAX_KCYCLES.iter().map(|&c| Some(c)).collect(),
    ));
    let groups: Vec<String> = TOKAMAX_MB.iter().map(|(g, _, _)| g.to_string()).collect();
    Some(bars("tpu7x:2x2x1 static cycles, bf16, primary shape (thousands)", "k cycles", &groups, &series))
}

/// The scaling suite: time (the program alone, and calls through the host API on one device
/// and context-parallel on two), and CPU scratch and tpu7x peak, against T.
fn scaling(rs: &[&BenchRecord]) -> Vec<(&'static str, Chart)> {
    let pick = |f: &dyn Fn(&BenchRecord) -> bool| -> Vec<&BenchRecord> {
        let mut v: Vec<&BenchRecord> =
            rs.iter().copied().filter(|r| r.suite == Suite::Scaling && f(r)).collect();
        v.sort_by_key(|r| r.shape[2]);
        v
    };
    let program = |dtype: DType| pick(&|r| r.variant == Variant::FusedSavedState && r.dtype == dtype);
    let (f32s, bf16s) = (program(DType::F32), program(DType::BF16));
    if f32s.is_empty() && bf16s.is_empty() {
        return Vec::new();
    }
    let pts = |v: &[&BenchRecord], y: &dyn Fn(&BenchRecord) -> Option<f64>| -> Vec<(f64, f64)> {
        v.iter().filter_map(|r| y(r).map(|y| (r.shape[2] as f64, y))).collect()
    };
    let mut time = Vec::new();
    let mut memory = Vec::new();
    for (d, v) in [(DType::F32, &f32s), (DType::BF16, &bf16s)] {
        if v.is_empty() {
            continue;
        }
        time.push((format!("{d} program alone, 1 device"), pts(v, &|r| Some(r.median_ms()))));
        memory.push((
            format!("{d} CPU scratch, fixed, 1 device"),
            pts(v, &|r| Some(r.cpu_temp() as f64 / 1e6)),
        ));
        for packed in [false, true] {
            for devices in [1, 2] {
                let calls = pick(&|r| {
                    r.variant == Variant::HostApi
                        && r.dtype == d
                        && r.packed() == packed
                        && r.devices == devices
                });
                if calls.is_empty() {
                    continue;
                }
                let what = if packed { "packed" } else { "fixed" };
                let plural = |n: usize| if n > 1 { "s" } else { "" };
                let name = format!("{d} host API, {what}, {devices} device{}", plural(devices));
                time.push((name, pts(&calls, &|r| Some(r.median_ms()))));
                // Memory per device of the call's program: CPU at this device count, tpu7x at
                // the device count of its figures.
                let cpu = pts(&calls, &|r| (!r.programs.is_empty()).then(|| r.cpu_peak() as f64 / 1e6));
                if !cpu.is_empty() {
                    let name =
                        format!("{d} CPU peak per device, {what}, {devices} device{}", plural(devices));
                    memory.push((name, cpu));
                }
                let tpu = pts(&calls, &|r| r.tpu_peak().map(|b| b as f64 / 1e6));
                if let Some(n) = calls.iter().find(|r| r.tpu_peak().is_some()).map(|r| r.tpu_devices()) {
                    memory.push((format!("{d} tpu7x peak per device, {what}, {n} device{}", plural(n)), tpu));
                }
            }
        }
    }
    vec![
        (
            "scaling-time.svg",
            lines(
                "Fused saved-state forward+VJP, H=8 K=V=128: time (2 devices share 2 cores)",
                "median ms",
                &time,
            ),
        ),
        (
            "scaling-memory.svg",
            lines("Fused saved-state forward+VJP, H=8 K=V=128: memory per device", "MB", &memory),
        ),
    ]
}

/// Every chart the records support, by file name.
pub fn all(rs: &[&BenchRecord]) -> Result<Vec<(&'static str, String)>, String> {
    let mut out = Vec::new();
    if let Some(c) = variant_times(rs) {
        out.push(("variant-times.svg", c?));
    }
    if let Some(c) = tpu_memory(rs) {
        out.push(("tpu7x-memory.svg", c?));
    }
    if let Some(c) = tpu_cycles(rs) {
        out.push(("tpu7x-cycles.svg", c?));
    }
    for (name, c) in scaling(rs) {
        out.push((name, c?));
    }
    Ok(out)
}
