//! One call of a kernel from a StableHLO function: its tables and inputs bound by their
//! handles, lowered as asked, its results read by their handles.

use super::body::{Place, Ref, Table};
use super::kernel::Kernel;
use super::Lowering;
use crate::error::{Result, TpuError};
use crate::hlo::{FnBuilder, TensorType, Value};

/// The values of one call of a kernel, each bound to the table or input it feeds.
#[derive(Clone, Debug)]
pub struct Bindings {
    kernel: u32,
    name: String,
    tables: Vec<Option<Value>>,
    inputs: Vec<Option<Value>>,
}

/// What one call returned, read by the kernel's output handles.
#[derive(Clone, Debug)]
pub struct Returned {
    kernel: u32,
    name: String,
    values: Vec<Value>,
}

fn err(kernel: &str, message: impl Into<String>) -> TpuError {
    TpuError::builder(format!("call of kernel {kernel}"), message)
}

impl Bindings {
    /// Binds `value` to table `table`.
    pub fn table(&mut self, table: Table, value: Value) -> Result<()> {
        if table.kernel != self.kernel {
            return Err(err(&self.name, "a table of another kernel"));
        }
        bind(&self.name, &mut self.tables, table.index, value, "table")
    }

    /// Binds `value` to input `input`.
    pub fn input(&mut self, input: Ref, value: Value) -> Result<()> {
        match (input.kernel == self.kernel, input.place) {
            (true, Place::Input(i)) => bind(&self.name, &mut self.inputs, i, value, "input"),
            (false, _) => Err(err(&self.name, "a reference of another kernel")),
            (true, _) => Err(err(&self.name, format!("{input:?} is a result or scratch, not an input"))),
        }
    }
}

fn bind(kernel: &str, slots: &mut [Option<Value>], i: usize, value: Value, what: &str) -> Result<()> {
    match slots.get_mut(i) {
        Some(slot @ None) => {
            *slot = Some(value);
            Ok(())
        }
        Some(Some(_)) => Err(err(kernel, format!("{what} {i} bound twice"))),
        None => Err(err(kernel, format!("no {what} {i}"))),
    }
}

impl Returned {
    /// The value of result `output`.
    pub fn get(&self, output: Ref) -> Result<Value> {
        match (output.kernel == self.kernel, output.place) {
            (true, Place::Output(i)) => {
                self.values.get(i).copied().ok_or_else(|| err(&self.name, format!("no result {i}")))
            }
            _ => Err(err(&self.name, format!("{output:?} is not a result of this kernel"))),
        }
    }
}

impl Kernel {
    /// Empty bindings for a call of this kernel.
    pub fn bindings(&self) -> Bindings {
        Bindings {
            kernel: self.tag,
            name: self.name.clone(),
            tables: vec![None; self.tables.len()],
            inputs: vec![None; self.inputs.len()],
        }
    }

    /// The kernel called from `f` on `args` (every table and input bound), lowered as
    /// `lowering` says.
    pub fn call(&self, f: &mut FnBuilder, lowering: Lowering, args: Bindings) -> Result<Returned> {
        if args.kernel != self.tag {
            return Err(err(&self.name, "bindings made for another kernel"));
        }
        let names = self.tables.iter().map(|(n, _)| n).chain(self.inputs.iter().map(|o| &o.name));
        let mut operands = Vec::new();
        for (value, name) in args.tables.into_iter().chain(args.inputs).zip(names) {
            operands.push(value.ok_or_else(|| err(&self.name, format!("`{name}` is not bound")))?);
        }
        let values = self.call_lowered(f, lowering, &operands)?;
        Ok(Returned { kernel: self.tag, name: self.name.clone(), values })
    }

    /// The row-major `operand_layouts` and `result_layouts` of a custom call of this kernel on
    /// `operands` (checked against the kernel's operand types; `what` names the lowering).
    pub(super) fn custom_call_layouts(&self, what: &str, operands: &[Value]) -> Result<(String, String)> {
        let want = self.operand_types();
        let got: Vec<TensorType> = operands.iter().map(Value::ty).collect();
        if got != want {
            return Err(TpuError::builder(
                format!("{what} call {}", self.name),
                format!("operands {got:?}, the kernel takes {want:?}"),
            ));
        }
        let layout = |t: &TensorType| {
            let r = t.dims.len();
            let order: Vec<String> = (0..r).rev().map(|d| d.to_string()).collect();
            match r {
                1 => "dense<0> : tensor<1xindex>".to_string(),
                _ => format!("dense<[{}]> : tensor<{r}xindex>", order.join(", ")),
            }
        };
        let all = |ts: &[TensorType]| ts.iter().map(layout).collect::<Vec<_>>().join(", ");
        Ok((all(&want), all(&self.result_types())))
    }

    /// The kernel called on `operands` in the order the lowerings take them: the tables, then
    /// the inputs.
    pub(super) fn call_lowered(
        &self,
        f: &mut FnBuilder,
        lowering: Lowering,
        operands: &[Value],
    ) -> Result<Vec<Value>> {
        match lowering {
            Lowering::Mosaic => self.call_mosaic(f, operands),
            Lowering::Interpret => self.call_interpret(f, operands),
            Lowering::Triton => self.call_triton(f, operands),
        }
    }
}
