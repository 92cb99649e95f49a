//! The table of a run of descriptor-heavy rounds: medians over rounds of each side's
//! figures, and the medians of the per-round ratios Rust/Python and Rust/CMA (CMA: the
//! better of one run per call and 64 per call in that round), with the goals.

use std::collections::BTreeMap;
use std::path::Path;

use super::tables::{Case, PER_REQUEST, REGIONS};
use super::Res;

/// Rust's GB/s at least this many times Python's, in every case.
const GOAL_PYTHON: f64 = 2.0;
/// Rust's GB/s at least this fraction of CMA's, with contiguous blocks.
const GOAL_CMA: f64 = 0.9;

/// (lang, case, metric) → round → value.
type Figures = BTreeMap<(String, String, String), BTreeMap<u64, f64>>;

/// Writes the table of the JSON lines in `input` to `out` (and prints it).
pub fn write(input: &Path, out: &Path) -> Res<()> {
    let mut figures = Figures::new();
    for line in std::fs::read_to_string(input)?.lines() {
        let record: serde_json::Value = serde_json::from_str(line)?;
        let text = |key: &str| record[key].as_str().unwrap_or_default().to_string();
        let (Some(round), Some(value)) = (record["round"].as_u64(), record["value"].as_f64())
        else {
            continue;
        };
        figures
            .entry((text("lang"), text("workload"), text("metric")))
            .or_default()
            .insert(round, value);
    }
    let table = table(&figures);
    print!("{table}");
    std::fs::write(out, table)?;
    Ok(())
}

fn table(figures: &Figures) -> String {
    let series = |lang: &str, case: Case, metric: &str| {
        figures
            .get(&(lang.into(), case.name().into(), metric.into()))
            .cloned()
            .unwrap_or_default()
    };
    let mut text = format!(
        "**Descriptor-heavy READs** ({REGIONS} regions, {PER_REQUEST} blocks of 16 KiB per request: \
         {} descriptors, 310 MB; medians over rounds; ratios: medians of per-round ratios; CMA: the better of \
         1 and 64 runs per `process_vm_readv` in each round)\n\n\
         | case | Rust post ms | Rust complete ms | Rust GB/s | NIXL descriptors after merging | Python post ms | \
         Python complete ms | Python GB/s | CMA 1/call GB/s | CMA 64/call GB/s | Rust/Python | Rust/CMA | goals |\n\
         | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |\n",
        REGIONS * PER_REQUEST
    );
    for case in Case::ALL {
        let rust = series("rust", case, "gbps");
        let python = series("python", case, "gbps");
        let (one, many) = (
            series("cma-1", case, "gbps"),
            series("cma-64", case, "gbps"),
        );
        let cma: BTreeMap<u64, f64> = one
            .iter()
            .filter_map(|(r, &v)| Some((*r, v.max(*many.get(r)?))))
            .collect();
        let vs_python = ratio(&rust, &python);
        let vs_cma = ratio(&rust, &cma);
        let mut goals = vec![goal("Rust/Python", vs_python, GOAL_PYTHON)];
        if case == Case::Contiguous {
            goals.push(goal("Rust/CMA", vs_cma, GOAL_CMA));
        }
        let cell =
            |v: Option<f64>, digits: usize| v.map_or("n/a".into(), |v| format!("{v:.digits$}"));
        let ratio_cell = |v: Option<f64>| v.map_or("n/a".into(), |v| format!("{v:.2}x"));
        text += &format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
            case.name(),
            cell(median(&series("rust", case, "post_ms")), 2),
            cell(median(&series("rust", case, "complete_ms")), 2),
            cell(median(&rust), 2),
            cell(median(&series("rust", case, "descriptors")), 0),
            cell(median(&series("python", case, "post_ms")), 2),
            cell(median(&series("python", case, "complete_ms")), 2),
            cell(median(&python), 2),
            cell(median(&one), 2),
            cell(median(&many), 2),
            ratio_cell(vs_python),
            ratio_cell(vs_cma),
            goals.join("; "),
        );
    }
    text
}

/// The median of the per-round ratios `a / b` over the rounds both have.
fn ratio(a: &BTreeMap<u64, f64>, b: &BTreeMap<u64, f64>) -> Option<f64> {
    let ratios: BTreeMap<u64, f64> = a
        .iter()
        .filter_map(|(r, &x)| Some((*r, x / b.get(r)?)))
        .collect();
    median(&ratios)
}

fn median(values: &BTreeMap<u64, f64>) -> Option<f64> {
    let mut v: Vec<f64> = values.values().copied().collect();
    v.sort_by(f64::total_cmp);
    (!v.is_empty()).then(|| v[v.len() / 2])
}

fn goal(name: &str, value: Option<f64>, at_least: f64) -> String {
    match value {
        Some(v) if v >= at_least => format!("{name} ≥ {at_least} **met**"),
        Some(_) => format!("{name} ≥ {at_least} **missed**"),
        None => format!("{name} ≥ {at_least}: not measured"),
    }
}
