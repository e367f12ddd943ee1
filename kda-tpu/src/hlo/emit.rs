//! `Module` (a set of functions) and its text.

use std::collections::BTreeMap;

use super::builder::FnBuilder;
use super::error::{err, Result};
use super::fmt::{check_symbol, fmt_types};
use super::types::TensorType;

/// Functions collected into one `module`; [`Module::to_text`] emits the StableHLO program.
#[derive(Debug, Default)]
pub struct Module {
    name: Option<String>,
    funcs: Vec<FnBuilder>,
}

impl Module {
    /// An unnamed module.
    pub fn new() -> Self {
        Module::default()
    }

    /// A module emitted as `module @name`.
    pub fn named(name: &str) -> Result<Self> {
        check_symbol("module", name)?;
        Ok(Module { name: Some(name.to_string()), funcs: Vec::new() })
    }

    /// Adds a finished function (after `ret`). Callees must be added before their callers;
    /// each `call` is checked against the callee's signature here.
    pub fn add(&mut self, f: FnBuilder) -> Result<()> {
        let op = "module_add";
        check_symbol(op, &f.name)?;
        if f.results.is_none() {
            return Err(err(op, format!("function @{} has no `ret`", f.name)));
        }
        if self.funcs.iter().any(|g| g.name == f.name) {
            return Err(err(op, format!("function @{} added twice", f.name)));
        }
        let sigs: BTreeMap<&str, (Vec<TensorType>, &[TensorType])> = self
            .funcs
            .iter()
            .map(|g| {
                let args = g.params.iter().map(|(v, _)| v.ty()).collect();
                (g.name.as_str(), (args, g.results.as_deref().unwrap_or(&[])))
            })
            .collect();
        for c in &f.calls {
            let Some((args, results)) = sigs.get(c.callee.as_str()) else {
                return Err(err(
                    "call",
                    format!("@{} calls @{}, which is not in the module yet", f.name, c.callee),
                ));
            };
            if *args != c.args || *results != c.results.as_slice() {
                return Err(err(
                    "call",
                    format!(
                        "@{} calls @{} as ({}) -> ({}), but it is ({}) -> ({})",
                        f.name,
                        c.callee,
                        fmt_types(&c.args),
                        fmt_types(&c.results),
                        fmt_types(args),
                        fmt_types(results)
                    ),
                ));
            }
        }
        self.funcs.push(f);
        Ok(())
    }

    /// The StableHLO text: deterministic (same program, same text), usable as a cache key.
    pub fn to_text(&self) -> String {
        let mut out = match &self.name {
            Some(n) => format!("module @{n} {{\n"),
            None => "module {\n".to_string(),
        };
        for f in &self.funcs {
            for line in fn_text(f).lines() {
                out.push_str("  ");
                out.push_str(line);
                out.push('\n');
            }
        }
        out.push_str("}\n");
        out
    }
}

/// `func.func` text of one finished function.
fn fn_text(f: &FnBuilder) -> String {
    let params: Vec<String> = f
        .params
        .iter()
        .map(|(v, alias)| match alias {
            Some(o) => format!("{v}: {} {{tf.aliasing_output = {o} : i32}}", v.ty()),
            None => format!("{v}: {}", v.ty()),
        })
        .collect();
    let results = f.results.as_deref().unwrap_or(&[]);
    let vis = if f.public { "public" } else { "private" };
    let mut s =
        format!("func.func {vis} @{}({}) -> ({}) {{\n", f.name, params.join(", "), fmt_types(results));
    for line in f.body_lines() {
        s.push_str(line);
        s.push('\n');
    }
    s.push_str("}\n");
    s
}
