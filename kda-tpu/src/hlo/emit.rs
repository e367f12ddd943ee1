//! `Module` (a set of functions) and the text formatting shared by the ops.

use std::collections::BTreeMap;

use super::builder::FnBuilder;
use super::error::{err, Result};
use super::types::TensorType;
use kda_core::DType;

/// `t1, t2, ...` (operand type lists inside parentheses).
pub(crate) fn fmt_types(types: &[TensorType]) -> String {
    types.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
}

/// `t` for one result, `(t1, t2)` otherwise.
pub(crate) fn fmt_result_types(types: &[TensorType]) -> String {
    if types.len() == 1 {
        types[0].to_string()
    } else {
        format!("({})", fmt_types(types))
    }
}

/// `array<i64: 1, 2>` (`array<i64>` when empty): the dense-array attribute form plugins accept.
pub(crate) fn fmt_array(xs: &[i64]) -> String {
    if xs.is_empty() {
        "array<i64>".to_string()
    } else {
        format!("array<i64: {}>", join(xs))
    }
}

/// `[1, 2]` (lists inside `#stablehlo.dot<...>` and `#stablehlo.gather<...>`).
pub(crate) fn fmt_list(xs: &[i64]) -> String {
    format!("[{}]", join(xs))
}

fn join(xs: &[i64]) -> String {
    xs.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
}

/// An exact, deterministic float literal for a splat of `elem`: shortest round-trip decimal
/// with a mantissa dot (`1.0e-2`), or the bit pattern in hex for inf/nan.
pub(crate) fn fmt_float(x: f32, elem: DType) -> String {
    if x.is_finite() {
        let s = format!("{x:e}");
        match s.split_once('e') {
            Some((m, e)) if !m.contains('.') => format!("{m}.0e{e}"),
            _ => s,
        }
    } else if elem == DType::BF16 {
        format!("0x{:04X}", (x.to_bits() >> 16) as u16 | if x.is_nan() { 0x40 } else { 0 })
    } else if elem == DType::F64 {
        format!("0x{:016X}", f64::from(x).to_bits())
    } else {
        format!("0x{:08X}", x.to_bits())
    }
}

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

/// Symbol names are plain identifiers: `[A-Za-z_][A-Za-z0-9_.$]*`.
pub(crate) fn check_symbol(op: &str, name: &str) -> Result<()> {
    let mut chars = name.chars();
    let ok_first = chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_');
    if ok_first && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '$')) {
        Ok(())
    } else {
        Err(err(op, format!("bad symbol name {name:?} (want [A-Za-z_][A-Za-z0-9_.$]*)")))
    }
}
