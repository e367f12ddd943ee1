//! The committed benchmark results (`docs/bench/results.json`): every suite's latest records,
//! read back into records, and everything rendered from them (the sections of
//! `docs/performance.md` and the charts in `docs/charts/`). `cargo xtask bench` replaces the
//! records of the suites it ran and re-renders; a test re-renders the committed JSON and
//! compares with the committed files.

use std::path::{Path, PathBuf};

use kda_core::DType;
use serde_json::Value as Json;

use crate::bench::{
    markdown_section, record_json, BenchRecord, Memory, ProgramFigures, RunInfo, Suite, TpuFigures, Variant,
};
use crate::machine::Machine;

/// The results file, relative to the docs folder.
pub const RESULTS: &str = "bench/results.json";
/// The charts folder, relative to the docs folder.
pub const CHARTS: &str = "charts";

/// One record with the run it came from.
pub type Entry = (BenchRecord, RunInfo);

fn field<'a>(j: &'a Json, key: &str) -> Result<&'a Json, String> {
    j.get(key).ok_or_else(|| format!("a record without `{key}`"))
}
fn text(j: &Json, key: &str) -> Result<String, String> {
    field(j, key)?.as_str().map(str::to_string).ok_or_else(|| format!("`{key}` is not a string"))
}
fn number(j: &Json, key: &str) -> Result<f64, String> {
    field(j, key)?.as_f64().ok_or_else(|| format!("`{key}` is not a number"))
}
fn int(j: &Json, key: &str) -> Result<i64, String> {
    field(j, key)?.as_i64().ok_or_else(|| format!("`{key}` is not an integer"))
}

fn memory(j: &Json) -> Result<Memory, String> {
    Ok(Memory {
        argument: int(j, "argument_bytes")?,
        output: int(j, "output_bytes")?,
        alias: int(j, "alias_bytes")?,
        temp: int(j, "temp_bytes")?,
        code: int(j, "generated_code_bytes")?,
        peak: int(j, "peak_bytes")?,
    })
}

fn program(j: &Json) -> Result<ProgramFigures, String> {
    let name = match text(j, "name")?.as_str() {
        "forward" => "forward",
        "backward" => "backward",
        "fused" => "fused",
        "context-parallel fused" => "context-parallel fused",
        other => return Err(format!("unknown program `{other}`")),
    };
    let tpu = match field(j, "tpu7x")? {
        Json::Null => None,
        t => Some(TpuFigures {
            memory: memory(field(t, "memory")?)?,
            devices: t.get("devices").and_then(Json::as_u64).map_or(1, |d| d as usize),
            flops: number(t, "flops")?,
            bytes_accessed: number(t, "bytes_accessed")?,
            compile_ms: number(t, "compile_ms")?,
            // Records written before static cycles were counted have none.
            cycles: t.get("static_cycles").and_then(Json::as_i64),
        }),
    };
    Ok(ProgramFigures {
        name,
        kind: text(j, "kind")?,
        compile_ms: number(j, "compile_ms")?,
        cpu: memory(field(j, "cpu_memory")?)?,
        tpu,
    })
}

/// A record and its run back from [`record_json`]'s form.
pub fn entry_from_json(j: &Json) -> Result<Entry, String> {
    let suite = Suite::parse(&text(j, "suite")?).ok_or("unknown suite")?;
    let variant = Variant::parse(&text(j, "variant")?).ok_or("unknown variant")?;
    let dtype = DType::parse(&text(j, "dtype")?).ok_or("unknown dtype")?;
    let shape = field(j, "shape")?;
    let dim = |k: &str| int(shape, k).map(|x| x as usize);
    let segments = match field(j, "segments")? {
        Json::Null => None,
        Json::Array(a) => Some(
            a.iter()
                .map(|x| x.as_u64().map(|x| x as usize).ok_or("a segment length"))
                .collect::<Result<_, _>>()?,
        ),
        _ => return Err("`segments` is neither null nor a list".into()),
    };
    let times_ms = field(j, "times_ms")?
        .as_array()
        .ok_or("`times_ms` is not a list")?
        .iter()
        .map(|x| x.as_f64().ok_or("a time"))
        .collect::<Result<_, _>>()?;
    let programs = field(j, "programs")?
        .as_array()
        .ok_or("`programs` is not a list")?
        .iter()
        .map(program)
        .collect::<Result<_, _>>()?;
    let record = BenchRecord {
        suite,
        variant,
        dtype,
        case: text(j, "case")?,
        shape: [dim("h")?, dim("b")?, dim("t")?, dim("k")?, dim("v")?],
        segments,
        times_ms,
        programs,
        devices: j.get("devices").and_then(Json::as_u64).map_or(1, |d| d as usize),
    };
    let info = RunInfo {
        machine: Machine {
            cpus: int(j, "cpus")? as usize,
            cpu_model: text(j, "cpu_model")?,
            cpu_detail: text(j, "cpu_detail")?,
            date: text(j, "date")?,
            commit: text(j, "commit")?,
        },
        command: text(j, "command")?,
        plugin: text(j, "backend")?,
        libtpu: field(j, "libtpu")?.as_str().map(str::to_string),
    };
    Ok((record, info))
}

/// The entries of a results file (none when it does not exist).
pub fn read(path: &Path) -> Result<Vec<Entry>, String> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(format!("read {}: {e}", path.display())),
    };
    let all: Json = serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    all.as_array()
        .ok_or_else(|| format!("{}: not a JSON list of records", path.display()))?
        .iter()
        .enumerate()
        .map(|(i, j)| entry_from_json(j).map_err(|e| format!("{} record {i}: {e}", path.display())))
        .collect()
}

/// The entries as the results file holds them.
pub fn to_text(entries: &[Entry]) -> Result<String, String> {
    let all = Json::Array(entries.iter().map(|(r, i)| record_json(r, i)).collect());
    Ok(serde_json::to_string_pretty(&all).map_err(|e| format!("JSON of the records: {e}"))? + "\n")
}

/// `old` with the records of the suites in `fresh` replaced by `fresh`'s, in suite order.
pub fn merge(old: Vec<Entry>, fresh: Vec<Entry>) -> Vec<Entry> {
    let ran: Vec<Suite> = fresh.iter().map(|(r, _)| r.suite).collect();
    let mut all: Vec<Entry> = old.into_iter().filter(|(r, _)| !ran.contains(&r.suite)).collect();
    all.extend(fresh);
    all.sort_by_key(|(r, _)| Suite::ALL.iter().position(|s| *s == r.suite));
    all
}

/// What the results render to: one markdown section per suite present, and the charts.
pub struct Rendered {
    /// `(suite, section text)`.
    pub sections: Vec<(Suite, String)>,
    /// `(file name, SVG text)`.
    pub charts: Vec<(&'static str, String)>,
}

/// Renders every section and chart from `entries` (rounded as the results file holds them).
pub fn render(entries: &[Entry]) -> Result<Rendered, String> {
    let mut sections = Vec::new();
    for suite in Suite::ALL {
        let records: Vec<BenchRecord> =
            entries.iter().filter(|(r, _)| r.suite == suite).map(|(r, _)| r.clone()).collect();
        if let Some((_, info)) = entries.iter().find(|(r, _)| r.suite == suite) {
            sections.push((suite, markdown_section(suite, &records, info)));
        }
    }
    let records: Vec<&BenchRecord> = entries.iter().map(|(r, _)| r).collect();
    Ok(Rendered { sections, charts: crate::charts::all(&records)? })
}

/// The results file and charts folder next to `markdown` (its `docs` folder).
pub fn paths(markdown: &Path) -> (PathBuf, PathBuf) {
    let dir = markdown.parent().unwrap_or(Path::new("."));
    (dir.join(RESULTS), dir.join(CHARTS))
}

/// Merges `fresh` into the results next to `markdown`, writes them, and re-renders the
/// markdown sections and the charts from what was written.
pub fn update(markdown: &Path, fresh: Vec<Entry>) -> Result<Vec<PathBuf>, String> {
    let (results, charts) = paths(markdown);
    let text = to_text(&merge(read(&results)?, fresh))?;
    write(&results, &text)?;
    // Render from the file's own (rounded) values, so a re-render gives the same bytes.
    let rendered = render(&read(&results)?)?;
    for (suite, section) in &rendered.sections {
        crate::bench::write_markdown(markdown, *suite, section)?;
    }
    let mut written = vec![results];
    for (name, svg) in &rendered.charts {
        let path = charts.join(name);
        write(&path, svg)?;
        written.push(path);
    }
    Ok(written)
}

fn write(path: &Path, text: &str) -> Result<(), String> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| format!("create {}: {e}", dir.display()))?;
    }
    std::fs::write(path, text).map_err(|e| format!("write {}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn docs() -> PathBuf {
        crate::cargo_cmd::root().join("docs")
    }

    /// The committed tables and charts are what the committed results render to.
    #[test]
    fn committed_tables_and_charts_match_their_results() {
        let entries = read(&docs().join(RESULTS)).expect("docs/bench/results.json");
        assert!(!entries.is_empty(), "docs/bench/results.json holds no records");
        let rendered = render(&entries).expect("render");
        let markdown = std::fs::read_to_string(docs().join("performance.md")).expect("docs/performance.md");
        for (suite, section) in &rendered.sections {
            assert!(
                markdown.contains(section.as_str()),
                "docs/performance.md's `{}` section is not what docs/bench/results.json renders to; \
                 run `cargo xtask bench --suite {}` (or re-render) and commit both",
                suite.name(),
                suite.name()
            );
        }
        for (name, svg) in &rendered.charts {
            let path = docs().join(CHARTS).join(name);
            let committed =
                std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            assert!(committed == *svg, "{} is not what docs/bench/results.json renders to", path.display());
        }
    }

    #[test]
    fn records_read_back_as_written() {
        let entries = read(&docs().join(RESULTS)).expect("results");
        let again: Vec<Entry> = to_text(&entries)
            .and_then(|t| serde_json::from_str::<Json>(&t).map_err(|e| e.to_string()))
            .expect("text")
            .as_array()
            .expect("list")
            .iter()
            .map(|j| entry_from_json(j).expect("entry"))
            .collect();
        assert_eq!(again, entries);
    }

    #[test]
    fn merge_replaces_the_suites_that_ran() {
        let entries = read(&docs().join(RESULTS)).expect("results");
        let api: Vec<Entry> = entries.iter().filter(|(r, _)| r.suite == Suite::Api).cloned().collect();
        let merged = merge(entries.clone(), api[..1].to_vec());
        assert_eq!(merged.iter().filter(|(r, _)| r.suite == Suite::Api).count(), 1);
        assert_eq!(merged.len(), entries.len() - api.len() + 1);
    }
}
