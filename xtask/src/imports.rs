//! Import circles between the source files of a crate: each file's module, the files its
//! `use crate::..`, `use super::..` and `use self::..` items (each item of a grouped list) and
//! its inline `crate::..` and `super::..` paths name (resolved to the file that defines the
//! item, through re-exports), and the strongly connected components of that graph. Comments are
//! not code: doc links make no edge.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// One crate's module tree: module path (`crate::a::b` as `["a", "b"]`) to its file's text.
#[derive(Debug, Default)]
pub struct Crate {
    /// Module path to (file name relative to the crate root, code without comments).
    pub modules: BTreeMap<Vec<String>, (String, String)>,
}

/// `text` without `//` comments (line and doc comments; strings holding `//` are rare enough in
/// this workspace's `use` lines and paths not to matter).
fn code(text: &str) -> String {
    text.lines()
        .map(|l| match l.find("//") {
            Some(i) => &l[..i],
            None => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The `mod name;` declarations of a file's code (not inline modules).
fn child_modules(code: &str) -> Vec<String> {
    let mut out = Vec::new();
    for line in code.lines() {
        let t = line.trim();
        let t = t.strip_prefix("pub(crate) ").or_else(|| t.strip_prefix("pub(super) ")).unwrap_or(t);
        let t = t.strip_prefix("pub ").unwrap_or(t);
        if let Some(rest) = t.strip_prefix("mod ") {
            if let Some(name) = rest.strip_suffix(';') {
                out.push(name.trim().to_string());
            }
        }
    }
    out
}

impl Crate {
    /// Reads the module tree of the crate whose root file is `root` (`src/lib.rs` or
    /// `src/main.rs`); `files` maps a path to its text (the disk, or a test's plants).
    pub fn read(root: &Path, files: &dyn Fn(&Path) -> Option<String>) -> Crate {
        let mut c = Crate::default();
        let base = root.parent().unwrap_or(Path::new("")).to_path_buf();
        let mut todo = vec![(Vec::<String>::new(), root.to_path_buf())];
        while let Some((path, file)) = todo.pop() {
            let Some(text) = files(&file) else { continue };
            let body = code(&text);
            let dir = match file.file_name().and_then(|n| n.to_str()) {
                Some("mod.rs" | "lib.rs" | "main.rs") => file.parent().unwrap_or(Path::new("")).to_path_buf(),
                _ => file.with_extension(""),
            };
            for child in child_modules(&body) {
                let mut p = path.clone();
                p.push(child.clone());
                let flat = dir.join(format!("{child}.rs"));
                let nested = dir.join(&child).join("mod.rs");
                let f = if files(&flat).is_some() { flat } else { nested };
                todo.push((p, f));
            }
            let name = file.strip_prefix(&base).unwrap_or(&file).display().to_string();
            c.modules.insert(path, (name, body));
        }
        c
    }

    /// The file that defines `path` (absolute module path plus maybe an item): the module the
    /// longest prefix names, then through that module's `pub use` of the next segment.
    fn resolve(&self, path: &[String], depth: usize) -> Option<String> {
        let mut n = path.len();
        while n > 0 && !self.modules.contains_key(&path[..n]) {
            n -= 1;
        }
        let (file, body) = self.modules.get(&path[..n])?;
        if n == path.len() || depth > 8 {
            return Some(file.clone());
        }
        // A re-export of the item: follow it to its definition.
        let item = &path[n];
        for target in reexports(body) {
            if target.last() == Some(item) && target.len() > 1 {
                if let Some(abs) = absolute(&path[..n], &target) {
                    if abs != path[..=n] {
                        if let Some(f) = self.resolve(&abs, depth + 1) {
                            return Some(f);
                        }
                    }
                }
            }
        }
        Some(file.clone())
    }

    /// The file-to-file edges of the crate (no self edges).
    pub fn edges(&self) -> BTreeSet<(String, String)> {
        let mut out = BTreeSet::new();
        for (module, (file, body)) in &self.modules {
            for (inner, part) in inline_modules(module, body) {
                let mut paths = use_paths(&part);
                paths.extend(inline_paths(&part));
                for p in paths {
                    let Some(abs) = absolute(&inner, &p) else { continue };
                    if let Some(to) = self.resolve(&abs, 0) {
                        if &to != file {
                            out.insert((file.clone(), to));
                        }
                    }
                }
            }
        }
        out
    }
}

/// A file's code cut by the inline modules it holds (`mod tests { .. }`): each part with the
/// module path it is in, so that `super` inside `mod tests` names the file's own module.
fn inline_modules(module: &[String], body: &str) -> Vec<(Vec<String>, String)> {
    let mut parts: BTreeMap<Vec<String>, String> = BTreeMap::new();
    let mut stack: Vec<(String, i64)> = Vec::new();
    let mut depth = 0i64;
    for line in body.lines() {
        let mut path = module.to_vec();
        path.extend(stack.iter().map(|(n, _)| n.clone()));
        let t = line.trim();
        let t = t.strip_prefix("pub(crate) ").or_else(|| t.strip_prefix("pub(super) ")).unwrap_or(t);
        let t = t.strip_prefix("pub ").unwrap_or(t);
        let opens = t.strip_prefix("mod ").and_then(|r| r.strip_suffix('{')).map(|n| n.trim().to_string());
        let entry = parts.entry(path).or_default();
        entry.push_str(line);
        entry.push('\n');
        if let Some(name) = opens {
            stack.push((name, depth));
        }
        depth += line.matches('{').count() as i64 - line.matches('}').count() as i64;
        while stack.last().is_some_and(|&(_, d)| depth <= d) {
            stack.pop();
        }
    }
    parts.into_iter().collect()
}

/// `p` (starting with `crate`, `super` or `self`) as an absolute module path from `module`.
fn absolute(module: &[String], p: &[String]) -> Option<Vec<String>> {
    let mut base: Vec<String> = module.to_vec();
    let mut rest = p;
    match p.first().map(String::as_str) {
        Some("crate") => {
            base.clear();
            rest = &p[1..];
        }
        Some("self") => rest = &p[1..],
        Some("super") => {
            while rest.first().map(String::as_str) == Some("super") {
                base.pop()?;
                rest = &rest[1..];
            }
        }
        // A path from a child module of `module` (the 2018 edition's relative `use`).
        _ => {}
    }
    base.extend(rest.iter().filter(|s| s.as_str() != "*").cloned());
    Some(base)
}

/// Every path a `use` item of `body` names, grouped lists expanded (`use a::{b, c::{d}}` is
/// `a::b` and `a::c::d`), for items that start with `crate`, `super` or `self`: the edges.
pub fn use_paths(body: &str) -> Vec<Vec<String>> {
    let mut out = use_trees(body);
    out.retain(|p| matches!(p.first().map(String::as_str), Some("crate" | "super" | "self")));
    out
}

/// The paths of the `pub use` and `pub(crate) use` items of `body`, relative ones too (what a
/// re-export resolves by).
fn reexports(body: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    for vis in ["pub use ", "pub(crate) use ", "pub(super) use "] {
        let mut rest = body;
        while let Some(i) = find_word(rest, vis) {
            let after = &rest[i + vis.len() - 4..];
            let end = after.find(';').unwrap_or(after.len());
            out.extend(use_trees(&after[..end]));
            rest = &after[end..];
        }
    }
    out
}

/// Every path a `use` item of `body` names, relative ones too.
fn use_trees(body: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let mut rest = body;
    while let Some(i) = find_word(rest, "use ") {
        let after = &rest[i + 4..];
        let end = after.find(';').unwrap_or(after.len());
        // Renames (`x as y`) dropped, then the whitespace.
        let mut item = String::new();
        let mut renamed = false;
        for t in after[..end].split_whitespace() {
            if renamed {
                item.push_str(t.trim_start_matches(|c: char| c.is_alphanumeric() || c == '_'));
                renamed = false;
            } else if t == "as" {
                renamed = true;
            } else {
                item.push_str(t);
            }
        }
        expand(&[], &item, &mut out);
        rest = &after[end..];
    }
    out
}

/// The position of `word` in `s` at a word boundary.
fn find_word(s: &str, word: &str) -> Option<usize> {
    let mut from = 0;
    while let Some(i) = s[from..].find(word) {
        let at = from + i;
        let before = s[..at].chars().last();
        if before.is_none_or(|c| !(c.is_alphanumeric() || c == '_' || c == ':' || c == '$')) {
            return Some(at);
        }
        from = at + word.len();
    }
    None
}

/// Expands one `use` tree (whitespace removed) under `prefix` into `out`.
fn expand(prefix: &[String], tree: &str, out: &mut Vec<Vec<String>>) {
    if let Some(open) = tree.find('{') {
        let head: Vec<String> =
            tree[..open].split("::").filter(|s| !s.is_empty()).map(String::from).collect();
        let mut base = prefix.to_vec();
        base.extend(head);
        let close = tree.rfind('}').filter(|&c| c > open).unwrap_or(tree.len());
        let inner = &tree[open + 1..close];
        let mut depth = 0;
        let mut start = 0;
        for (i, ch) in inner.char_indices() {
            match ch {
                '{' => depth += 1,
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    expand(&base, &inner[start..i], out);
                    start = i + 1;
                }
                _ => {}
            }
        }
        expand(&base, &inner[start..], out);
    } else if !tree.is_empty() {
        let mut p = prefix.to_vec();
        p.extend(tree.split("::").filter(|s| !s.is_empty() && *s != "self").map(String::from));
        out.push(p);
    }
}

/// The inline `crate::a::b` and `super::a::b` paths of `body` outside `use` items.
pub fn inline_paths(body: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    for line in body.lines().filter(|l| !l.trim_start().starts_with("use ") && !l.contains(" use ")) {
        for start in ["crate::", "super::"] {
            let mut rest = line;
            while let Some(i) = find_word(rest, start) {
                let tail = &rest[i..];
                let len =
                    tail.find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':')).unwrap_or(tail.len());
                let p: Vec<String> =
                    tail[..len].split("::").filter(|s| !s.is_empty()).map(String::from).collect();
                if p.len() > 1 {
                    out.push(p);
                }
                rest = &tail[len..];
            }
        }
    }
    out
}

/// The circles of `edges`: strongly connected components of two files or more, each sorted.
pub fn circles(edges: &BTreeSet<(String, String)>) -> Vec<Vec<String>> {
    let nodes: BTreeSet<&String> = edges.iter().flat_map(|(a, b)| [a, b]).collect();
    let reach = |from: &String| -> BTreeSet<String> {
        let mut seen = BTreeSet::new();
        let mut todo = vec![from.clone()];
        while let Some(n) = todo.pop() {
            for (a, b) in edges {
                if *a == n && seen.insert(b.clone()) {
                    todo.push(b.clone());
                }
            }
        }
        seen
    };
    let reached: BTreeMap<&String, BTreeSet<String>> = nodes.iter().map(|n| (*n, reach(n))).collect();
    let mut out: Vec<Vec<String>> = Vec::new();
    for n in &nodes {
        let mut scc: Vec<String> = nodes
            .iter()
            .filter(|m| reached[*n].contains(**m) && reached[*m].contains(*n))
            .map(|m| (*m).clone())
            .collect();
        scc.sort();
        if scc.len() > 1 && !out.contains(&scc) {
            out.push(scc);
        }
    }
    out
}

/// The circles of every crate of the workspace at `root`, as `crate: a -> b -> ..` lines.
pub fn workspace_circles(root: &Path) -> Vec<String> {
    let mut out = Vec::new();
    for krate in ["kda-core", "kda-ref", "kda-packed", "kda-tpu", "kda-testkit", "xtask"] {
        let src = root.join(krate).join("src");
        let lib = if src.join("lib.rs").exists() { src.join("lib.rs") } else { src.join("main.rs") };
        let c = Crate::read(&lib, &|p: &Path| std::fs::read_to_string(p).ok());
        let edges = c.edges();
        for circle in circles(&edges) {
            let inside: Vec<String> = edges
                .iter()
                .filter(|(a, b)| circle.contains(a) && circle.contains(b))
                .map(|(a, b)| format!("{a} -> {b}"))
                .collect();
            out.push(format!("{krate}: {} ({})", circle.join(", "), inside.join("; ")));
        }
    }
    out
}

/// The workspace root (xtask's parent).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap_or(Path::new(".")).to_path_buf()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// A crate of planted files: `lib.rs` declares `a`, `b`, `c` and `d` (a folder).
    fn planted(b_text: &str) -> BTreeSet<(String, String)> {
        let files: HashMap<PathBuf, String> = [
            ("src/lib.rs", "pub mod a;\nmod b;\nmod c;\npub mod d;\npub use c::Thing;\n"),
            ("src/a.rs", "use crate::b::Helper;\n"),
            ("src/b.rs", b_text),
            ("src/c.rs", "pub struct Thing;\n"),
            ("src/d/mod.rs", "mod e;\npub use e::Deep;\n"),
            ("src/d/e.rs", "pub struct Deep;\n/// [`crate::a`] in a doc comment is no edge.\n"),
        ]
        .into_iter()
        .map(|(p, t)| (PathBuf::from(p), t.to_string()))
        .collect();
        Crate::read(Path::new("src/lib.rs"), &|p: &Path| files.get(p).cloned()).edges()
    }

    fn edge(a: &str, b: &str) -> (String, String) {
        (a.to_string(), b.to_string())
    }

    #[test]
    fn each_form_of_import_makes_an_edge() {
        // A grouped `use crate::..` item, a `use super::..` through a re-export in lib.rs, a
        // `use self::..` (no edge: the file itself), an inline `crate::..` path through the
        // re-export of a folder module, and a doc comment that makes none.
        let e = planted(
            "use crate::{a, d::Deep};\nuse super::Thing;\nuse self::Helper as H;\npub struct Helper;\nfn f() { crate::d::Deep; }\n",
        );
        for want in [edge("a.rs", "b.rs"), edge("b.rs", "a.rs"), edge("b.rs", "c.rs"), edge("b.rs", "d/e.rs")]
        {
            assert!(e.contains(&want), "{want:?} missing from {e:?}");
        }
        assert!(!e.iter().any(|(a, b)| a == "d/e.rs" && b == "a.rs"), "doc comments make no edge: {e:?}");
        assert_eq!(circles(&e), vec![vec!["a.rs".to_string(), "b.rs".to_string()]]);
    }

    #[test]
    fn an_inline_path_alone_closes_a_circle() {
        let e = planted("pub struct Helper;\nfn f() { let _ = crate::a::x(); }\n");
        assert_eq!(circles(&e), vec![vec!["a.rs".to_string(), "b.rs".to_string()]]);
        assert!(circles(&planted("pub struct Helper;\n")).is_empty());
    }

    /// No crate of the workspace has an import circle.
    #[test]
    fn no_crate_has_an_import_circle() {
        let found = workspace_circles(&workspace_root());
        assert!(found.is_empty(), "import circles:\n{}", found.join("\n"));
    }
}
