//! One call of a kernel from a StableHLO function: its tables and inputs bound by their
//! handles, lowered by any [`super::Lower`], its results read by their handles.

use super::ir::{Place, Ref, Table};
use crate::error::{Result, TpuError};
use crate::hlo::Value;

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

impl Bindings {
    /// Empty bindings for a call of the kernel tagged `kernel`, named `name`, with `tables`
    /// tables and `inputs` inputs.
    pub(super) fn new(kernel: u32, name: &str, tables: usize, inputs: usize) -> Bindings {
        Bindings { kernel, name: name.to_string(), tables: vec![None; tables], inputs: vec![None; inputs] }
    }

    /// The bound values in the order the lowerings take them (the tables, then the inputs),
    /// once every one is bound; `kernel` is the tag of the kernel called, `names` its tables'
    /// and inputs' names in that order.
    pub(super) fn operands<'a>(
        self,
        kernel: u32,
        names: impl Iterator<Item = &'a String>,
    ) -> Result<Vec<Value>> {
        if self.kernel != kernel {
            return Err(err(&self.name, "bindings made for another kernel"));
        }
        let mut operands = Vec::new();
        for (value, name) in self.tables.into_iter().chain(self.inputs).zip(names) {
            operands.push(value.ok_or_else(|| err(&self.name, format!("`{name}` is not bound")))?);
        }
        Ok(operands)
    }
}

impl Returned {
    /// What a call of the kernel tagged `kernel`, named `name`, returned.
    pub(super) fn new(kernel: u32, name: &str, values: Vec<Value>) -> Returned {
        Returned { kernel, name: name.to_string(), values }
    }
}
