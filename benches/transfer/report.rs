//! Turns the JSON lines of a benchmark run into a markdown table of medians and ratios and
//! SVG plots: GB/s against transfer size, and the 4 KiB round trip of the async variants.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use plotters::coord::Shift;
use plotters::prelude::*;

use super::awaiting::{Completer, SETUPS};
use super::{Res, SWEEP};

/// The configuration name of the cross-process demo's records.
pub const XPROC_CONFIG: &str = "prefill/decode";

/// The cross-process demo's shapes (all 32 layers × 16 KiB blocks, 4 in flight): the
/// workload name of its records, and the shape in words.
pub const XPROC_SHAPES: [(&str, &str); 2] = [
    ("xproc", "256 requests × 16 blocks"),
    ("xproc_200x32", "200 requests × 32 blocks"),
];

/// A table row: label, workload, metric, unit, and the target on Rust/Python
/// (at least or at most, and the bound).
type Row = (
    &'static str,
    &'static str,
    &'static str,
    &'static str,
    Option<(bool, f64)>,
);

/// (lang, config, workload, metric) -> round -> value.
type Runs = BTreeMap<(String, String, String, String), BTreeMap<u64, f64>>;

fn load(input: &Path) -> Res<Runs> {
    let mut runs = Runs::new();
    for line in std::fs::read_to_string(input)?
        .lines()
        .filter(|l| !l.trim().is_empty())
    {
        let r: serde_json::Value = serde_json::from_str(line)?;
        let field = |k: &str| {
            r[k].as_str()
                .map(str::to_string)
                .ok_or(format!("record without {k}: {line}"))
        };
        let key = (
            field("lang")?,
            field("config")?,
            field("workload")?,
            field("metric")?,
        );
        let round = r["round"].as_u64().ok_or("record without round")?;
        let value = r["value"].as_f64().ok_or("record without value")?;
        runs.entry(key).or_default().insert(round, value);
    }
    Ok(runs)
}

fn median(mut values: Vec<f64>) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    values.sort_by(f64::total_cmp);
    let n = values.len();
    Some(if n % 2 == 1 {
        values[n / 2]
    } else {
        (values[n / 2 - 1] + values[n / 2]) / 2.0
    })
}

/// One series of a run: its values by round.
struct Series<'a>(Option<&'a BTreeMap<u64, f64>>);

impl Series<'_> {
    fn median(&self) -> Option<f64> {
        median(self.0?.values().copied().collect())
    }

    /// Median over rounds of the per-round ratio self / other (same round, same run).
    fn ratio(&self, other: &Series<'_>) -> Option<f64> {
        self.per_round(other, |v, o| v / o)
    }

    /// Median over rounds of the per-round difference self - other.
    fn difference(&self, other: &Series<'_>) -> Option<f64> {
        self.per_round(other, |v, o| v - o)
    }

    /// Median over rounds of `f(self, other)` for the rounds both have.
    fn per_round(&self, other: &Series<'_>, f: impl Fn(f64, f64) -> f64) -> Option<f64> {
        let (mine, theirs) = (self.0?, other.0?);
        median(
            mine.iter()
                .filter_map(|(round, v)| theirs.get(round).map(|o| f(*v, *o)))
                .collect(),
        )
    }
}

fn series<'a>(
    runs: &'a Runs,
    lang: &str,
    config: &str,
    workload: &str,
    metric: &str,
) -> Series<'a> {
    Series(runs.get(&(lang.into(), config.into(), workload.into(), metric.into())))
}

fn fmt(v: Option<f64>, digits: usize) -> String {
    v.map_or("n/a".into(), |v| format!("{v:.digits$}"))
}

/// A ratio, or n/a when there is none (e.g. 0/0).
fn fmt_ratio(v: Option<f64>) -> String {
    v.filter(|v| v.is_finite())
        .map_or("n/a".into(), |v| format!("{v:.2}x"))
}

/// A target on a ratio: at least (`true`) or at most (`false`) `bound`.
fn verdict(v: Option<f64>, at_least: bool, bound: f64) -> String {
    let sign = if at_least { "≥" } else { "≤" };
    match v {
        Some(v) if (at_least && v >= bound) || (!at_least && v <= bound) => {
            format!("{sign} {bound} **met**")
        }
        Some(_) => format!("{sign} {bound} **missed**"),
        None => format!("{sign} {bound} n/a"),
    }
}

fn size_name(size: usize) -> String {
    if size >= 1 << 20 {
        format!("{} MiB", size >> 20)
    } else {
        format!("{} KiB", size >> 10)
    }
}

pub fn write(input: &Path, out_dir: &Path) -> Res<()> {
    let runs = load(input)?;
    let rounds = runs
        .values()
        .flat_map(|r| r.keys().copied())
        .collect::<std::collections::BTreeSet<_>>()
        .len();
    let rust = |c: &str, w: &str, m: &str| series(&runs, "rust", c, w, m);
    let py = |w: &str, m: &str| series(&runs, "python", "default", w, m);
    let mem = |w: &str| series(&runs, "memcpy", "1 thread", w, "gbps");

    let mut md = String::new();
    writeln!(md, "Medians over {rounds} rounds of one run; ratios are medians of per-round ratios (Rust and Python alternate A B A B).\n")?;
    writeln!(md, "| workload | metric | Rust (crate default) | Python (API default) | Rust/Python | memcpy | Rust/memcpy | target |")?;
    writeln!(md, "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |")?;
    let memcpy64 = mem("w1_write");
    for (w, label) in [("w1_write", "WRITE"), ("w1_read", "READ")] {
        let best = runs
            .iter()
            .filter(|((lang, _, workload, metric), _)| {
                lang == "rust" && workload == w && metric == "gbps"
            })
            .filter_map(|((_, config, _, _), values)| {
                Some((config.as_str(), Series(Some(values)).median()?))
            })
            .max_by(|x, y| x.1.total_cmp(&y.1))
            .map_or("default", |(config, _)| config);
        for (config, label, rust_target) in [
            ("default", format!("W1 bulk {label} 64 MiB"), true),
            (
                best,
                format!("W1 {label}, best Rust config of this run: {best}"),
                false,
            ),
        ] {
            let r = rust(config, w, "gbps");
            let p = py(w, "gbps");
            let (vs_py, vs_mem) = (r.ratio(&p), r.ratio(&memcpy64));
            let target = if rust_target {
                format!("Rust/Python {}", verdict(vs_py, true, 1.4))
            } else {
                format!("Rust/memcpy {}", verdict(vs_mem, true, 1.2))
            };
            writeln!(
                md,
                "| {label} | GB/s | {} | {} | {} | {} | {} | {target} |",
                fmt(r.median(), 2),
                fmt(p.median(), 2),
                fmt_ratio(vs_py),
                fmt(memcpy64.median(), 2),
                fmt_ratio(vs_mem),
            )?;
        }
    }
    let two = series(&runs, "memcpy", "2 threads", "w1_write", "gbps");
    writeln!(
        md,
        "| memcpy, 2 threads (ceiling of any 2-way split of W1) | GB/s | | | | {} | {} (2 threads / 1) | |",
        fmt(two.median(), 2),
        fmt_ratio(two.ratio(&memcpy64)),
    )?;
    for (w, label) in [("w1_write", "WRITE"), ("w1_read", "READ")] {
        for descs in [2, 4] {
            let r = rust(&format!("ucx-mt2+{descs}desc"), w, "gbps");
            let p = py(w, "gbps");
            writeln!(
                md,
                "| W1 {label}, UCX num_threads=2 split_batch_size=1, {descs} descriptors | GB/s | {} | {} | {} | {} | {} | |",
                fmt(r.median(), 2),
                fmt(p.median(), 2),
                fmt_ratio(r.ratio(&p)),
                fmt(memcpy64.median(), 2),
                fmt_ratio(r.ratio(&memcpy64)),
            )?;
        }
    }
    let mut xproc = String::new();
    for (workload, shape) in XPROC_SHAPES {
        let (demo, demo_mem) = (rust(XPROC_CONFIG, workload, "gbps"), mem(workload));
        xproc += &format!(
            "cross-process prefill/decode demo, {shape}: {} GB/s (median of {} runs) = {} of a 1-thread memcpy of the same blocks ({} GB/s)\n",
            fmt(demo.median(), 2),
            demo.0.map_or(0, BTreeMap::len),
            fmt_ratio(demo.ratio(&demo_mem)),
            fmt(demo_mem.median(), 2),
        );
        writeln!(
            md,
            "| Cross-process prefill/decode demo, {shape} (2 processes, decode READs 16 KiB blocks through the connector, verifies every byte); memcpy: 1 thread, same blocks | GB/s | {} | | | {} | {} | |",
            fmt(demo.median(), 2),
            fmt(demo_mem.median(), 2),
            fmt_ratio(demo.ratio(&demo_mem)),
        )?;
    }
    let rows: [Row; 10] = [
        (
            "W2 kv-blocks fresh (1024 × 32 KiB READ)",
            "w2_fresh",
            "req_per_s",
            "req/s",
            Some((true, 1.5)),
        ),
        (
            "W2 kv-blocks prepared",
            "w2_prepared",
            "req_per_s",
            "req/s",
            Some((true, 1.5)),
        ),
        ("W2 kv-blocks fresh", "w2_fresh", "gbps", "GB/s", None),
        ("W2 kv-blocks prepared", "w2_prepared", "gbps", "GB/s", None),
        (
            "W3 small 4 KiB WRITE: create, post, wait, release",
            "w3_small",
            "us_per_iter",
            "µs/iter",
            Some((false, 0.33)),
        ),
        (
            "W4 build 2 × 100,000 descriptors + request",
            "w4_build",
            "ms",
            "ms",
            Some((false, 1.0)),
        ),
        (
            "CPU cost W1 WRITE",
            "w1_write",
            "cpu_s_per_gb",
            "CPU s/GB",
            None,
        ),
        (
            "CPU cost W1 READ",
            "w1_read",
            "cpu_s_per_gb",
            "CPU s/GB",
            None,
        ),
        (
            "CPU cost W2 fresh",
            "w2_fresh",
            "cpu_s_per_gb",
            "CPU s/GB",
            None,
        ),
        (
            "CPU cost W2 prepared",
            "w2_prepared",
            "cpu_s_per_gb",
            "CPU s/GB",
            None,
        ),
    ];
    for (label, w, m, unit, target) in rows {
        let (r, p) = (rust("default", w, m), py(w, m));
        let ratio = r.ratio(&p);
        let target = target.map_or(String::new(), |(at_least, bound)| {
            format!("Rust/Python {}", verdict(ratio, at_least, bound))
        });
        writeln!(
            md,
            "| {label} | {unit} | {} | {} | {} | | | {target} |",
            fmt(r.median(), 3),
            fmt(p.median(), 3),
            fmt_ratio(ratio),
        )?;
    }
    let (ri, pi) = (rust("default", "idle", "core_pct"), py("idle", "core_pct"));
    let idle_target = match ri.median() {
        Some(v) if v <= 5.0 => "Rust ≤ 5 % **met**",
        Some(_) => "Rust ≤ 5 % **missed**",
        None => "Rust ≤ 5 % n/a",
    };
    writeln!(
        md,
        "| Idle agent (UCX backend, no traffic) | % of a core | {} | {} | {} | | | {idle_target} |",
        fmt(ri.median(), 2),
        fmt(pi.median(), 2),
        fmt_ratio(ri.ratio(&pi)),
    )?;

    let latency = write_async(&mut md, &runs)?;
    write_concurrent(&mut md, &runs)?;

    writeln!(md, "\n**Alternative Rust configurations** (same run; ratios against the crate default and the Python default):\n")?;
    writeln!(
        md,
        "| config | workload | metric | median | vs Rust default | vs Python default |"
    )?;
    writeln!(md, "| --- | --- | --- | ---: | ---: | ---: |")?;
    for ((lang, config, w, m), values) in &runs {
        if lang != "rust"
            || config == "default"
            || config == XPROC_CONFIG
            || is_async_variant(config)
        {
            continue;
        }
        let s = Series(Some(values));
        writeln!(
            md,
            "| {config} | {w} | {m} | {} | {} | {} |",
            fmt(s.median(), 3),
            fmt_ratio(s.ratio(&rust("default", w, m))),
            fmt_ratio(s.ratio(&py(w, m))),
        )?;
    }

    writeln!(
        md,
        "\n**W4 breakdown** (ms, median run of each round, medians over rounds):\n"
    )?;
    writeln!(md, "| part | Rust | Python | Rust/Python |")?;
    writeln!(md, "| --- | ---: | ---: | ---: |")?;
    for (part, m) in [
        ("local list", "local_ms"),
        ("remote list", "remote_ms"),
        ("create request", "create_ms"),
        ("total", "ms"),
        ("total, the measuring thread's CPU time", "cpu_ms"),
    ] {
        let (r, p) = (rust("default", "w4_build", m), py("w4_build", m));
        writeln!(
            md,
            "| {part} | {} | {} | {} |",
            fmt(r.median(), 3),
            fmt(p.median(), 3),
            fmt_ratio(r.ratio(&p))
        )?;
    }

    writeln!(
        md,
        "\n**Size sweep** (one-descriptor WRITE, request reposted; GB/s):\n"
    )?;
    writeln!(
        md,
        "| size | Rust | Python | memcpy | Rust/Python | Rust/memcpy |"
    )?;
    writeln!(md, "| ---: | ---: | ---: | ---: | ---: | ---: |")?;
    let mut lines: [Vec<(f64, f64)>; 3] = Default::default();
    for size in SWEEP {
        let w = format!("sweep_{size}");
        let (r, p, m) = (rust("default", &w, "gbps"), py(&w, "gbps"), mem(&w));
        writeln!(
            md,
            "| {} | {} | {} | {} | {} | {} |",
            size_name(size),
            fmt(r.median(), 2),
            fmt(p.median(), 2),
            fmt(m.median(), 2),
            fmt_ratio(r.ratio(&p)),
            fmt_ratio(r.ratio(&m)),
        )?;
        for (line, s) in lines.iter_mut().zip([r, p, m]) {
            if let Some(v) = s.median() {
                line.push((size as f64, v));
            }
        }
    }
    // Kept from benches/registered_copy.rs, which runs on its own (not part of this run).
    if let Ok(kept) = std::fs::read_to_string(out_dir.join("registered_copy.md")) {
        md.push_str(&kept);
    }
    std::fs::create_dir_all(out_dir)?;
    std::fs::write(out_dir.join("results.md"), &md)?;
    plot(&out_dir.join("transfer.svg"), &lines)?;
    plot_latency(&out_dir.join("latency.svg"), &latency)?;
    println!("{md}\n{}", xproc.trim_end());
    Ok(())
}

fn plot(path: &Path, lines: &[Vec<(f64, f64)>; 3]) -> Res<()> {
    let root = SVGBackend::new(path, (800, 500)).into_drawing_area();
    root.fill(&WHITE)?;
    let values = lines.iter().flatten().map(|&(_, v)| v);
    let top = values.clone().fold(1.0, f64::max) * 1.5;
    let bottom = values.fold(top, f64::min).min(1.0) / 1.5;
    let (lo, hi) = (SWEEP[0] as f64, SWEEP[SWEEP.len() - 1] as f64);
    let sizes: Vec<f64> = SWEEP.iter().map(|&s| s as f64).collect();
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "NIXL UCX DRAM transfer, one process, 2 agents: GB/s vs size",
            ("sans-serif", 20),
        )
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(55)
        .build_cartesian_2d(
            (lo * 0.8..hi * 1.25).log_scale().with_key_points(sizes),
            (bottom..top).log_scale(),
        )?;
    chart
        .configure_mesh()
        .x_desc("transfer size (one descriptor, WRITE A -> B)")
        .y_desc("GB/s, log scale (median over rounds)")
        .x_label_formatter(&|v| size_name(*v as usize))
        .x_labels(SWEEP.len())
        .draw()?;
    let styles = [
        ("Rust nixl crate (default config)", RED),
        ("Python nixl_cu12 (default config)", BLUE),
        ("memcpy, 1 thread", BLACK),
    ];
    for (points, (name, color)) in lines.iter().zip(styles) {
        chart
            .draw_series(LineSeries::new(
                points.iter().copied(),
                color.stroke_width(2),
            ))?
            .label(name)
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], color.stroke_width(2)));
        chart.draw_series(points.iter().map(|&p| Circle::new(p, 3, color.filled())))?;
    }
    legend_and_present(&mut chart, &root)
}

/// A row of the async table: label, workload, metric, unit, and the bounds (at most) on
/// await/blocking and await/sleep-poll.
type AsyncRow = (
    &'static str,
    &'static str,
    &'static str,
    &'static str,
    Option<f64>,
    Option<f64>,
);

const ASYNC_ROWS: [AsyncRow; 8] = [
    (
        "4 KiB WRITE round trip (request reused): mean",
        "rt_4k_write",
        "us_per_iter",
        "µs",
        Some(1.25),
        Some(0.02),
    ),
    (
        "4 KiB WRITE round trip: p50",
        "rt_4k_write",
        "p50_us",
        "µs",
        None,
        None,
    ),
    (
        "4 KiB WRITE round trip: p99",
        "rt_4k_write",
        "p99_us",
        "µs",
        None,
        None,
    ),
    (
        "4 KiB WRITE round trip: posts left in progress",
        "rt_4k_write",
        "in_progress_pct",
        "% of posts",
        None,
        None,
    ),
    (
        "W2 kv-blocks prepared (1024 × 32 KiB READ)",
        "w2_prepared",
        "req_per_s",
        "req/s",
        None,
        None,
    ),
    (
        "W2 kv-blocks prepared",
        "w2_prepared",
        "gbps",
        "GB/s",
        None,
        None,
    ),
    (
        "CPU cost W2 prepared",
        "w2_prepared",
        "cpu_s_per_gb",
        "CPU s/GB",
        Some(1.1),
        None,
    ),
    (
        "W2 kv-blocks prepared: posts left in progress",
        "w2_prepared",
        "in_progress_pct",
        "% of posts",
        None,
        None,
    ),
];

/// Writes `out` with the table of [`write_concurrent`] from the JSON lines `input` (runs of
/// `transfer concurrent` alone).
pub fn write_concurrent_only(input: &Path, out: &Path) -> Res<()> {
    let runs = load(input)?;
    let mut md = String::new();
    write_concurrent(&mut md, &runs)?;
    std::fs::write(out, md.trim_start())?;
    Ok(())
}

/// Writes the table of many tasks awaiting transfers against the same transfers one after
/// another (benches/transfer/concurrent.rs), with UCX's mutex worker lock (the crate's
/// default) and its spinlock (the baseline), and the awaited 4 KiB round trip under each.
fn write_concurrent(md: &mut String, runs: &Runs) -> Res<()> {
    writeln!(md, "\n**Many tasks awaiting transfers** (same run; {} tasks on a multi-thread tokio runtime, each posting and awaiting its own 16 KiB READ and checking every byte, against the same READs one after another with `post` and blocking `wait` on one thread; agents A and B in one process, or B in a child process over UCX; A's UCX worker lock a mutex (the crate's default) or UCX's spinlock (`engine_config=USE_MT_MUTEX=n`, the baseline), or the mutex with two UCX workers (`num_workers=2`, opt-in through `create_backend_with_unchecked`; request i on worker i mod 2 by `worker_id=` in its custom parameter); the six runs alternate 7 times per worker count and round; ratios are medians of per-repetition ratios, then over rounds; CPU of the whole process):\n", super::concurrent::REQUESTS)?;
    writeln!(md, "| setup | tokio workers | sequential ms | concurrent ms | concurrent/sequential | CPU s/GB sequential | CPU s/GB concurrent | spinlock: concurrent/sequential | spinlock: CPU s/GB concurrent | 2 UCX workers: concurrent/sequential | 2 UCX workers: CPU s/GB sequential | 2 UCX workers: CPU s/GB concurrent | target |")?;
    writeln!(
        md,
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"
    )?;
    let get = |setup: &str, lock: &str, how: &str, w: &str, m: &str| {
        series(runs, "rust", &format!("{setup} {lock} {how}"), w, m)
    };
    for setup in ["in-process", "cross-process"] {
        for workers in [1, 2, 4] {
            let w = format!("conc_16k_w{workers}");
            let ratio = get(setup, "mutex", "concurrent", &w, "ratio").median();
            let target = if setup == "in-process" && workers > 1 {
                format!("{} (goal 0.8)", verdict(ratio, false, 1.0))
            } else {
                String::new()
            };
            writeln!(
                md,
                "| {setup} | {workers} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {target} |",
                fmt(get(setup, "mutex", "sequential", &w, "ms").median(), 2),
                fmt(get(setup, "mutex", "concurrent", &w, "ms").median(), 2),
                fmt_ratio(ratio),
                fmt(
                    get(setup, "mutex", "sequential", &w, "cpu_s_per_gb").median(),
                    3
                ),
                fmt(
                    get(setup, "mutex", "concurrent", &w, "cpu_s_per_gb").median(),
                    3
                ),
                fmt_ratio(get(setup, "spinlock", "concurrent", &w, "ratio").median()),
                fmt(
                    get(setup, "spinlock", "concurrent", &w, "cpu_s_per_gb").median(),
                    3
                ),
                fmt_ratio(get(setup, "workers2", "concurrent", &w, "ratio").median()),
                fmt(
                    get(setup, "workers2", "sequential", &w, "cpu_s_per_gb").median(),
                    3
                ),
                fmt(
                    get(setup, "workers2", "concurrent", &w, "cpu_s_per_gb").median(),
                    3
                ),
            )?;
        }
    }
    let rt = |lock: &str, m: &str| series(runs, "rust", lock, "rt_4k_read_await", m);
    let ratio = rt("mutex", "ratio").median();
    writeln!(
        md,
        "\nAwaited 4 KiB READ round trip on one task (in-process, current-thread runtime, `post`, then `.await` if in progress): mutex {} µs, spinlock {} µs, 2 UCX workers {} µs, mutex/spinlock {}: {}.",
        fmt(rt("mutex", "us_per_iter").median(), 3),
        fmt(rt("spinlock", "us_per_iter").median(), 3),
        fmt(rt("workers2", "us_per_iter").median(), 3),
        fmt_ratio(ratio),
        verdict(ratio, false, 1.05),
    )?;
    Ok(())
}

/// p50 and p99 of the 4 KiB round trip (µs, medians over rounds) for one variant.
type Latency = (String, Option<f64>, Option<f64>);

/// Whether `config` names an async-completion variant of some setup.
fn is_async_variant(config: &str) -> bool {
    SETUPS.iter().any(|setup| {
        Completer::ALL
            .iter()
            .any(|c| config == format!("{}{}", setup.prefix, c.config()))
    })
}

/// Writes the table of the async completion variants; returns their round-trip latencies.
fn write_async(md: &mut String, runs: &Runs) -> Res<Vec<Latency>> {
    writeln!(md, "\n**Async completion** (same run; one tokio current-thread runtime on the measuring thread; await: `req.post()?; req.await?`, A's completion driver polls; blocking: `wait` in the task's thread; sleep-poll: `status()`, then a 5 ms `tokio::time::sleep` while in progress; the variants alternate within each round; ratios are medians of per-round ratios):\n")?;
    writeln!(md, "| setup | workload | metric | await | blocking | sleep-poll 5 ms | Python | await/blocking | await/sleep-poll | target |")?;
    writeln!(
        md,
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"
    )?;
    let mut latency = Vec::new();
    for setup in &SETUPS {
        let [awaited, blocking, sleep_poll] = Completer::ALL.map(|c| {
            let config = format!("{}{}", setup.prefix, c.config());
            move |w: &str, m: &str| series(runs, "rust", &config, w, m)
        });
        // Python runs UCX's defaults: comparable with the default setup only.
        let py = |w: &str, m: &str| {
            let lang = if setup.prefix.is_empty() {
                "python"
            } else {
                "none"
            };
            series(runs, lang, "default", w, m)
        };
        for (label, w, m, unit, vs_blocking, vs_sleep) in ASYNC_ROWS {
            let a = awaited(w, m);
            let (to_blocking, to_sleep) = (a.ratio(&blocking(w, m)), a.ratio(&sleep_poll(w, m)));
            let targets: Vec<String> = [
                ("await/blocking", to_blocking, vs_blocking),
                ("await/sleep-poll", to_sleep, vs_sleep),
            ]
            .into_iter()
            .filter_map(|(name, v, bound)| Some(format!("{name} {}", verdict(v, false, bound?))))
            .collect();
            let waited = awaited(w, "in_progress_pct").median();
            let targets = match waited {
                Some(pct) if pct < 1.0 && !targets.is_empty() => format!(
                    "{} (moot: {pct:.2} % of posts left in progress, the variants ran the same code)",
                    targets.join("; ")
                ),
                _ => targets.join("; "),
            };
            writeln!(
                md,
                "| {} | {label} | {unit} | {} | {} | {} | {} | {} | {} | {targets} |",
                setup.label,
                fmt(a.median(), 3),
                fmt(blocking(w, m).median(), 3),
                fmt(sleep_poll(w, m).median(), 3),
                fmt(py(w, m).median(), 3),
                fmt_ratio(to_blocking),
                fmt_ratio(to_sleep),
            )?;
        }
        if setup.idle {
            write_idle(
                md,
                setup.label,
                &awaited("idle_pair", "core_pct"),
                &blocking("idle_pair", "core_pct"),
            )?;
            writeln!(
                md,
                "| {} | Idle driver thread alone (its schedstat) | % of a core | {} | | | | | | |",
                setup.label,
                fmt(awaited("idle_driver_thread", "core_pct").median(), 3),
            )?;
        }
        for (how, name) in [
            (&awaited, "await"),
            (&blocking, "blocking"),
            (&sleep_poll, "sleep-poll"),
        ] {
            latency.push((
                format!("{}{name}", setup.prefix),
                how("rt_4k_write", "p50_us").median(),
                how("rt_4k_write", "p99_us").median(),
            ));
        }
    }
    let py = |m: &str| series(runs, "python", "default", "rt_4k_write", m).median();
    latency.push(("Python".to_string(), py("p50_us"), py("p99_us")));
    Ok(latency)
}

/// The idle row: the pair after one awaited READ started A's driver, against the same pair
/// before; the target is on the difference.
fn write_idle(
    md: &mut String,
    setup: &str,
    awaited: &Series<'_>,
    blocking: &Series<'_>,
) -> Res<()> {
    let extra = awaited.difference(blocking);
    writeln!(
        md,
        "| {setup} | Idle agents A and B: await = after one awaited READ started A's driver, blocking = the same agents before | % of a core | {} | {} | | | {} | | await − blocking: {} points ≤ 1 {} |",
        fmt(awaited.median(), 2),
        fmt(blocking.median(), 2),
        fmt_ratio(awaited.ratio(blocking)),
        fmt(extra, 2),
        match extra {
            Some(v) if v <= 1.0 => "**met**",
            Some(_) => "**missed**",
            None => "n/a",
        },
    )?;
    Ok(())
}

/// Bars of the 4 KiB round trip's p50 and p99 per variant, log scale.
fn plot_latency(path: &Path, latency: &[Latency]) -> Res<()> {
    let root = SVGBackend::new(path, (1000, 500)).into_drawing_area();
    root.fill(&WHITE)?;
    let values = latency
        .iter()
        .flat_map(|(_, p50, p99)| [*p50, *p99])
        .flatten();
    let top = values.clone().fold(1.0, f64::max) * 3.0;
    let bottom = values.fold(top, f64::min) / 3.0;
    let names: Vec<&str> = latency.iter().map(|l| l.0.as_str()).collect();
    // Variant i is centred on x = 10 i, its p50 bar left of it and its p99 bar right.
    let width = 10 * latency.len() as i32;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "4 KiB WRITE round trip (post + completion, request reused)",
            ("sans-serif", 20),
        )
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(55)
        .build_cartesian_2d(-5..width - 5, (bottom..top).log_scale())?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(latency.len())
        .y_desc("µs, log scale (median over rounds)")
        .x_label_formatter(&|&x| match usize::try_from(x / 10) {
            Ok(i) if x % 10 == 0 => names.get(i).map_or(String::new(), |n| n.to_string()),
            _ => String::new(),
        })
        .draw()?;
    for (offset, color, name, pick) in [(-4, BLUE, "p50", 0), (0, RED, "p99", 1)] {
        let bars = latency.iter().enumerate().filter_map(|(i, (_, p50, p99))| {
            let v = [*p50, *p99][pick]?;
            let x = 10 * i as i32 + offset;
            Some(Rectangle::new([(x, bottom), (x + 4, v)], color.filled()))
        });
        chart
            .draw_series(bars)?
            .label(name)
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 15, y + 5)], color.filled()));
    }
    legend_and_present(&mut chart, &root)
}

/// Draws the series' legend in the upper left corner and writes the chart out.
fn legend_and_present<'a, CT: CoordTranslate>(
    chart: &mut ChartContext<'a, SVGBackend<'a>, CT>,
    root: &DrawingArea<SVGBackend<'a>, Shift>,
) -> Res<()> {
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}
