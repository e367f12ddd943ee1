//! The house rules that can be checked from the text alone, each with its definition: function
//! and file lengths in `kda-tpu/src`, measured figures in its comments, and the shape of
//! `docs/design.md` (a design doc, not a notebook). `cargo xtask test` runs them as tests.

use std::path::{Path, PathBuf};

/// The longest a function of `kda-tpu/src` may be, in lines from its `fn` line to its closing
/// brace (a lowering's op dispatch is one method per op, not one match).
pub const MAX_FN_LINES: usize = 120;
/// The longest a file of `kda-tpu/src` may be, in lines.
pub const MAX_FILE_LINES: usize = 700;
/// Fewer comment lines than this in `kda-tpu/src` may carry a measured figure: comments keep
/// the reason, docs/performance.md the figure with its commit.
pub const MAX_FIGURE_COMMENTS: usize = 10;
/// The longest `docs/design.md` may be, in lines.
pub const MAX_DESIGN_LINES: usize = 400;
/// The longest block of `docs/design.md` (a run of non-blank lines: a paragraph, a list, a
/// table, a code block), in lines.
pub const MAX_DESIGN_BLOCK: usize = 20;

/// Whether `line` carries a measured figure. Measurements in this workspace are reported in
/// decimal units and counts, limits and sizes of the hardware in binary ones, so a figure is a
/// number followed by a time (`ns us ms s`), a decimal size (`kB KB MB GB TB`), a percent, a
/// cycle, bundle, vreg or register count, or a ratio (`1.2x`), or a number with a fraction
/// part followed by `k`, `M` or `G` (`59.5 k`, `1.779 M`). `16 MiB`, `64 x 64` and `K = 128`
/// are not figures.
pub fn has_figure(line: &str) -> bool {
    let b = line.as_bytes();
    let mut i = 0;
    while i < b.len() {
        let starts =
            b[i].is_ascii_digit() && (i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_'));
        if !starts {
            i += 1;
            continue;
        }
        let mut j = i;
        while j < b.len() && (b[j].is_ascii_digit() || b[j] == b',') {
            j += 1;
        }
        let mut fraction = false;
        if j + 1 < b.len() && b[j] == b'.' && b[j + 1].is_ascii_digit() {
            fraction = true;
            j += 1;
            while j < b.len() && b[j].is_ascii_digit() {
                j += 1;
            }
        }
        if unit_follows(&line[j..], fraction) {
            return true;
        }
        i = j.max(i + 1);
    }
    false
}

/// Whether `rest` (what follows a number) starts with a figure's unit.
fn unit_follows(rest: &str, fraction: bool) -> bool {
    if fraction && rest.starts_with('x') && !rest[1..].starts_with(|c: char| c.is_ascii_alphanumeric()) {
        return true;
    }
    if rest.starts_with('%') {
        return true;
    }
    let word: String = rest.trim_start_matches(' ').chars().take_while(|c| c.is_alphanumeric()).collect();
    const UNITS: [&str; 14] = [
        "ns",
        "us",
        "µs",
        "ms",
        "s",
        "kB",
        "KB",
        "MB",
        "GB",
        "TB",
        "cycles",
        "bundles",
        "vregs",
        "registers",
    ];
    UNITS.contains(&word.as_str()) || (fraction && matches!(word.as_str(), "k" | "M" | "G"))
}

/// One Rust file's functions longer than `max` lines: `(name, first line, lines)`. A function
/// runs from its `fn` line to the line of the brace that closes its body (braces counted
/// outside strings and comments); a declaration without a body (trait methods) has none.
pub fn long_functions(text: &str, max: usize) -> Vec<(String, usize, usize)> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    for (at, line) in lines.iter().enumerate() {
        let t = line.trim_start();
        if t.starts_with("//") {
            continue;
        }
        let Some(name) = fn_name(t) else { continue };
        let mut depth = 0i64;
        let mut opened = false;
        'scan: for (k, l) in lines.iter().enumerate().skip(at) {
            for c in code_chars(l) {
                match c {
                    '{' => {
                        depth += 1;
                        opened = true;
                    }
                    '}' => depth -= 1,
                    ';' if !opened && depth == 0 => break 'scan,
                    _ => {}
                }
                if opened && depth == 0 {
                    let n = k - at + 1;
                    if n > max {
                        out.push((name.clone(), at + 1, n));
                    }
                    break 'scan;
                }
            }
        }
    }
    out
}

/// The name of the function a trimmed line declares, if it does.
fn fn_name(t: &str) -> Option<String> {
    let mut rest = t;
    for prefix in [
        "pub(crate) ",
        "pub(super) ",
        "pub(in crate::op) ",
        "pub ",
        "const ",
        "unsafe ",
        "async ",
        "extern \"C\" ",
    ] {
        rest = rest.strip_prefix(prefix).unwrap_or(rest);
    }
    let rest = rest.strip_prefix("fn ")?;
    let name: String = rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
    (!name.is_empty()).then_some(name)
}

/// The characters of a line that are code: not inside a string or char literal, not after
/// `//`.
fn code_chars(line: &str) -> Vec<char> {
    let mut out = Vec::new();
    let chars: Vec<char> = line.chars().collect();
    let mut i = 0;
    let mut in_str = false;
    while i < chars.len() {
        let c = chars[i];
        if in_str {
            match c {
                '\\' => i += 1,
                '"' => in_str = false,
                _ => {}
            }
        } else if c == '"' {
            in_str = true;
        } else if c == '/' && chars.get(i + 1) == Some(&'/') {
            break;
        } else if c == '\'' && chars.get(i + 2) == Some(&'\'') {
            i += 2;
        } else if c == '\'' && chars.get(i + 1) == Some(&'\\') {
            i += 3;
        } else {
            out.push(c);
        }
        i += 1;
    }
    out
}

/// Every `.rs` file under `dir`, sorted.
pub fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else { continue };
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() {
                todo.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

/// What breaks the code rules under `src`: functions over [`MAX_FN_LINES`], files over
/// [`MAX_FILE_LINES`], and the comment lines that carry a figure when there are
/// [`MAX_FIGURE_COMMENTS`] or more.
pub fn code_findings(src: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut figures = Vec::new();
    for file in rust_files(src) {
        let Ok(text) = std::fs::read_to_string(&file) else { continue };
        let name = file.strip_prefix(src).unwrap_or(&file).display().to_string();
        let n = text.lines().count();
        if n > MAX_FILE_LINES {
            out.push(format!("{name}: {n} lines (at most {MAX_FILE_LINES})"));
        }
        for (f, at, len) in long_functions(&text, MAX_FN_LINES) {
            out.push(format!("{name}:{at}: fn {f} is {len} lines (at most {MAX_FN_LINES})"));
        }
        for (i, line) in text.lines().enumerate() {
            let t = line.trim_start();
            if t.starts_with("//") && has_figure(t) {
                figures.push(format!("{name}:{}: {}", i + 1, t));
            }
        }
    }
    if figures.len() >= MAX_FIGURE_COMMENTS {
        out.push(format!(
            "{} comment lines carry a figure (fewer than {MAX_FIGURE_COMMENTS}):",
            figures.len()
        ));
        out.extend(figures);
    }
    out
}

/// What breaks the rules of the design doc `text`: over [`MAX_DESIGN_LINES`] lines, a block over
/// [`MAX_DESIGN_BLOCK`] lines, a line with a figure.
pub fn design_findings(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let lines: Vec<&str> = text.lines().collect();
    if lines.len() > MAX_DESIGN_LINES {
        out.push(format!("{} lines (at most {MAX_DESIGN_LINES})", lines.len()));
    }
    let mut start = None;
    for (i, line) in lines.iter().chain(std::iter::once(&"")).enumerate() {
        match (line.trim().is_empty(), start) {
            (false, None) => start = Some(i),
            (true, Some(s)) => {
                if i - s > MAX_DESIGN_BLOCK {
                    out.push(format!(
                        "lines {}-{}: a block of {} lines (at most {MAX_DESIGN_BLOCK})",
                        s + 1,
                        i,
                        i - s
                    ));
                }
                start = None;
            }
            _ => {}
        }
    }
    for (i, line) in lines.iter().enumerate() {
        if has_figure(line) {
            out.push(format!("line {}: a figure: {}", i + 1, line.trim()));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[rstest::rstest]
    #[case::cycles("static cycles 59.5 k at the primary shape", true)]
    #[case::millions("1.779 M against 1.74 M", true)]
    #[case::time("took 1.30 ms", true)]
    #[case::seconds("compiles in 34 s", true)]
    #[case::decimal_size("peak 46.84 MB", true)]
    #[case::percent("about 54% of the work", true)]
    #[case::ratio("1.20x its fixed row", true)]
    #[case::bundles("5,645 bundles", true)]
    #[case::binary_size("v5e's 16 MiB default", false)]
    #[case::dims("a [64, 128] block, 64x64 inverse", false)]
    #[case::plain_number("K = 128, chunks of 64", false)]
    #[case::identifier("f32 and bf16, exp2", false)]
    fn a_figure_is_a_measured_quantity(#[case] line: &str, #[case] figure: bool) {
        assert_eq!(has_figure(line), figure, "{line}");
    }

    #[test]
    fn function_lengths_run_from_fn_to_its_closing_brace() {
        let body: String = (0..5).map(|i| format!("    let x{i} = \"}}\"; // }}\n")).collect();
        let text = format!("fn short() {{\n}}\n\npub(crate) fn long(a: u8) -> u8 {{\n{body}    a\n}}\ntrait T {{\n    fn decl(&self);\n}}\n");
        assert_eq!(long_functions(&text, 7), vec![("long".to_string(), 4, 8)]);
        assert!(long_functions(&text, 8).is_empty());
    }

    #[test]
    fn design_blocks_are_runs_of_non_blank_lines() {
        let long = vec!["- item"; MAX_DESIGN_BLOCK + 1].join("\n");
        let found = design_findings(&format!("# Title\n\nShort.\n\n{long}\n\nTook 3 ms.\n"));
        assert_eq!(found.len(), 2, "{found:?}");
        assert!(found[0].starts_with("lines 5-25: a block of 21 lines"), "{found:?}");
        assert!(found[1].starts_with("line 27: a figure"), "{found:?}");
    }

    /// `kda-tpu/src` keeps its functions, files and comments within the rules.
    #[test]
    fn kda_tpu_sources_keep_the_house_rules() {
        let found = code_findings(&crate::imports::workspace_root().join("kda-tpu/src"));
        assert!(found.is_empty(), "{}", found.join("\n"));
    }

    /// docs/design.md is a design doc: short, in short blocks, without figures.
    #[test]
    fn the_design_doc_keeps_its_shape() {
        let path = crate::imports::workspace_root().join("docs/design.md");
        let text = std::fs::read_to_string(&path).expect("docs/design.md");
        let found = design_findings(&text);
        assert!(found.is_empty(), "{}:\n{}", path.display(), found.join("\n"));
    }
}
