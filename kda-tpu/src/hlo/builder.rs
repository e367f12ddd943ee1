//! `FnBuilder`: one function's arguments, SSA numbering, region scopes and op emission.

use std::sync::atomic::{AtomicU32, Ordering};

use super::error::{err, Result};
use super::fmt::{fmt_result_types, fmt_types};
use super::types::{Precision, TensorType, Value, MAX_RANK, SINGLE};

/// Distinguishes values of different builders (a value used in the wrong function is an error).
static NEXT_FN_ID: AtomicU32 = AtomicU32::new(1);

/// A `func.call` made by a function, checked against the callee by `Module::add`.
#[derive(Clone, Debug)]
pub(crate) struct CallRecord {
    pub(crate) callee: String,
    pub(crate) args: Vec<TensorType>,
    pub(crate) results: Vec<TensorType>,
}

/// Builds one `func.func`: add arguments with [`FnBuilder::arg`], ops, then [`FnBuilder::ret`].
#[derive(Debug)]
pub struct FnBuilder {
    pub(crate) name: String,
    pub(crate) public: bool,
    fn_id: u32,
    /// Arguments in signature order, with an optional `tf.aliasing_output` index.
    pub(crate) params: Vec<(Value, Option<i64>)>,
    next_id: u32,
    /// Region in which each SSA id was defined (indexed by id).
    value_region: Vec<u32>,
    /// Regions open now, outermost (the function body, 0) first.
    active: Vec<u32>,
    next_region: u32,
    /// Text lines of each open region, innermost last.
    blocks: Vec<Vec<String>>,
    pub(crate) results: Option<Vec<TensorType>>,
    precision: Precision,
    pub(crate) calls: Vec<CallRecord>,
    /// Scratch buffers made so far ([`FnBuilder::scratch_f32`]).
    scratch: u32,
}

impl FnBuilder {
    /// A new function `@name`; `public` functions are entry points, private ones are `call` targets.
    pub fn new(name: impl Into<String>, public: bool) -> Self {
        FnBuilder {
            name: name.into(),
            public,
            fn_id: NEXT_FN_ID.fetch_add(1, Ordering::Relaxed),
            params: Vec::new(),
            next_id: 0,
            value_region: Vec::new(),
            active: vec![0],
            next_region: 1,
            blocks: vec![Vec::new()],
            results: None,
            precision: Precision::Default,
            calls: Vec::new(),
            scratch: 0,
        }
    }

    /// The function's symbol name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Precision emitted on every later `dot_general` (use `Highest` for f32 accuracy on TPU).
    pub fn set_dot_precision(&mut self, precision: Precision) {
        self.precision = precision;
    }

    /// An f32 tensor the caller overwrites entirely before reading it (a loop-carried output).
    /// Each one is filled with its own value (1, 2, ..), so XLA's CSE cannot merge two of them
    /// into one buffer that every loop updating it in place would then have to copy first.
    pub fn scratch_f32(&mut self, dims: &[i64]) -> Result<Value> {
        self.scratch += 1;
        let fill = self.scratch as f32;
        self.constant_f32(fill, TensorType::new(super::types::DType::F32, dims))
    }

    /// The precision `dot_general` currently emits.
    pub fn dot_precision(&self) -> Precision {
        self.precision
    }

    /// Adds a function argument of type `ty`.
    pub fn arg(&mut self, ty: TensorType) -> Result<Value> {
        self.add_param("arg", ty, None)
    }

    /// Adds an argument donated to result `output` (`tf.aliasing_output`): same type required.
    pub fn arg_aliased(&mut self, ty: TensorType, output: i64) -> Result<Value> {
        if output < 0 {
            return Err(err("arg_aliased", format!("output index {output} < 0")));
        }
        self.add_param("arg_aliased", ty, Some(output))
    }

    fn add_param(&mut self, op: &str, ty: TensorType, alias: Option<i64>) -> Result<Value> {
        check_type(op, &ty)?;
        let v = self.fresh_in(&ty, 0);
        self.params.push((v, alias));
        Ok(v)
    }

    /// Allocates an SSA id defined in `region`.
    fn fresh_in(&mut self, ty: &TensorType, region: u32) -> Value {
        let id = self.next_id;
        self.next_id += 1;
        self.value_region.push(region);
        Value::new(self.fn_id, id, SINGLE, ty)
    }

    fn current_region(&self) -> u32 {
        self.active.last().copied().unwrap_or(0)
    }

    /// True while no region (while body, reduce body) is open.
    pub(crate) fn at_top_level(&self) -> bool {
        self.active.len() == 1
    }

    /// Checks that `v` belongs to this function and is visible here (not from a closed region).
    pub(crate) fn check_operand(&self, op: &str, v: &Value) -> Result<()> {
        if v.fn_id != self.fn_id {
            return Err(err(op, format!("operand {v} ({}) belongs to another function", v.ty())));
        }
        let region = self.value_region.get(v.id as usize).copied();
        match region {
            Some(r) if self.active.contains(&r) => Ok(()),
            _ => Err(err(op, format!("operand {v} ({}) was defined in a region that is closed", v.ty()))),
        }
    }

    fn indent(&self) -> String {
        "  ".repeat(self.blocks.len())
    }

    /// Appends a raw line (already formatted, without indentation) to the innermost region.
    pub(crate) fn push_line(&mut self, line: &str) {
        let ind = self.indent();
        if let Some(block) = self.blocks.last_mut() {
            block.push(format!("{ind}{line}"));
        }
    }

    /// Emits a generic-syntax op with `regions` (from [`FnBuilder::region`]) and returns its results.
    pub(crate) fn push_op(
        &mut self,
        op: &str,
        mlir: &str,
        operands: &[Value],
        regions: &[String],
        attrs: &str,
        results: &[TensorType],
    ) -> Result<Vec<Value>> {
        for v in operands {
            self.check_operand(op, v)?;
        }
        for t in results {
            check_type(op, t)?;
        }
        let id = self.next_id;
        self.next_id += 1;
        let region = self.current_region();
        self.value_region.push(region);
        let lhs = match results.len() {
            0 => String::new(),
            1 => format!("%{id} = "),
            n => format!("%{id}:{n} = "),
        };
        let names: Vec<String> = operands.iter().map(Value::name).collect();
        let ind = self.indent();
        let regions_text = if regions.is_empty() {
            String::new()
        } else {
            let parts: Vec<String> = regions.iter().map(|r| format!("{{\n{r}\n{ind}}}")).collect();
            format!(" ({})", parts.join(", "))
        };
        let attrs_text = if attrs.is_empty() { String::new() } else { format!(" {{{attrs}}}") };
        let op_types: Vec<TensorType> = operands.iter().map(Value::ty).collect();
        let line = format!(
            "{lhs}\"{mlir}\"({}){regions_text}{attrs_text} : ({}) -> {}",
            names.join(", "),
            fmt_types(&op_types),
            fmt_result_types(results)
        );
        self.push_line(&line);
        let multi = results.len() > 1;
        Ok(results
            .iter()
            .enumerate()
            .map(|(i, t)| Value::new(self.fn_id, id, if multi { i as u32 } else { SINGLE }, t))
            .collect())
    }

    /// [`FnBuilder::push_op`] for single-result ops without regions.
    pub(crate) fn push_op1(
        &mut self,
        op: &str,
        mlir: &str,
        operands: &[Value],
        attrs: &str,
        result: TensorType,
    ) -> Result<Value> {
        let mut out = self.push_op(op, mlir, operands, &[], attrs, &[result])?;
        out.pop().ok_or_else(|| err(op, "internal: op produced no result"))
    }

    /// Builds one region (block with `arg_types` arguments) by running `f`, which returns
    /// the values of the terminating `stablehlo.return`. Returns the region text and those values.
    pub(crate) fn region<F>(
        &mut self,
        op: &str,
        arg_types: &[TensorType],
        f: F,
    ) -> Result<(String, Vec<Value>)>
    where
        F: FnOnce(&mut FnBuilder, &[Value]) -> Result<Vec<Value>>,
    {
        let region = self.next_region;
        self.next_region += 1;
        let ind = self.indent();
        let args: Vec<Value> = arg_types.iter().map(|t| self.fresh_in(t, region)).collect();
        self.active.push(region);
        self.blocks.push(Vec::new());
        let outcome = f(self, &args).and_then(|rets| {
            let types: Vec<TensorType> = rets.iter().map(Value::ty).collect();
            for v in &rets {
                self.check_operand(op, v)?;
            }
            let names: Vec<String> = rets.iter().map(Value::name).collect();
            self.push_line(&format!(
                "\"stablehlo.return\"({}) : ({}) -> ()",
                names.join(", "),
                fmt_types(&types)
            ));
            Ok(rets)
        });
        self.active.pop();
        let lines = self.blocks.pop().unwrap_or_default();
        let rets = outcome?;
        let params: Vec<String> = args.iter().map(|a| format!("{a}: {}", a.ty())).collect();
        let text = format!("{ind}^bb0({}):\n{}", params.join(", "), lines.join("\n"));
        Ok((text, rets))
    }

    /// The body lines (function level) for emission.
    pub(crate) fn body_lines(&self) -> &[String] {
        self.blocks.first().map(Vec::as_slice).unwrap_or(&[])
    }
}

/// Rejects ranks above [`MAX_RANK`] and negative dims.
pub(crate) fn check_type(op: &str, ty: &TensorType) -> Result<()> {
    if ty.rank() > MAX_RANK {
        return Err(err(op, format!("type {ty} has rank {} > {MAX_RANK}", ty.rank())));
    }
    if ty.dims.iter().any(|&d| d < 0) {
        return Err(err(op, format!("type {ty} has a negative dimension")));
    }
    Ok(())
}
