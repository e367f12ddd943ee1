//! Control flow and function boundaries: `stablehlo.while`, counted loops, `func.call`, return.

use super::builder::{CallRecord, FnBuilder};
use super::error::{err, Result};
use super::fmt::{check_symbol, fmt_types};
use super::types::{Cmp, TensorType, Value};
use kda_core::DType;

impl FnBuilder {
    /// `stablehlo.while`: `cond` maps the loop values to a `tensor<i1>`, `body` to new values of
    /// the same types as `init`. Regions may use values from enclosing scopes.
    pub fn while_loop<C, B>(&mut self, init: &[Value], cond: C, body: B) -> Result<Vec<Value>>
    where
        C: FnOnce(&mut FnBuilder, &[Value]) -> Result<Value>,
        B: FnOnce(&mut FnBuilder, &[Value]) -> Result<Vec<Value>>,
    {
        let op = "while_loop";
        if init.is_empty() {
            return Err(err(op, "no loop values"));
        }
        for v in init {
            self.check_operand(op, v)?;
        }
        let types: Vec<TensorType> = init.iter().map(Value::ty).collect();
        let (cond_text, pred) = self.region(op, &types, |b, args| Ok(vec![cond(b, args)?]))?;
        if let [p] = pred.as_slice() {
            if p.rank() != 0 || p.elem() != DType::I1 {
                return Err(err(op, format!("cond returned {}, want tensor<i1>", p.ty())));
            }
        }
        let (body_text, outs) = self.region(op, &types, body)?;
        let out_types: Vec<TensorType> = outs.iter().map(Value::ty).collect();
        if out_types != types {
            return Err(err(
                op,
                format!(
                    "body returned ({}), want the loop types ({})",
                    fmt_types(&out_types),
                    fmt_types(&types)
                ),
            ));
        }
        self.push_op(op, "stablehlo.while", init, &[cond_text, body_text], "", &types)
    }

    /// `stablehlo.optimization_barrier`: returns `values` unchanged, but the compiler may not move
    /// computation across it. Used to make XLA materialise a sum once instead of keeping (and
    /// storing) each of its terms for several consumers.
    pub fn barrier(&mut self, values: &[Value]) -> Result<Vec<Value>> {
        let op = "barrier";
        if values.is_empty() {
            return Err(err(op, "no values"));
        }
        let types: Vec<TensorType> = values.iter().map(Value::ty).collect();
        self.push_op(op, "stablehlo.optimization_barrier", values, &[], "", &types)
    }

    /// Counted loop `for i in 0..trips`: `body(b, i, values)` gets the i32 scalar counter and
    /// returns the next values (same types as `init`). Returns the final values.
    pub fn for_loop<B>(&mut self, trips: i32, init: &[Value], body: B) -> Result<Vec<Value>>
    where
        B: FnOnce(&mut FnBuilder, Value, &[Value]) -> Result<Vec<Value>>,
    {
        self.counted_loop(|b| b.scalar_i32(trips), init, body)
    }

    /// Counted loop `for i in 0..trips` with a run-time trip count (an i32 scalar from an
    /// enclosing scope); otherwise as [`FnBuilder::for_loop`].
    pub fn for_loop_until<B>(&mut self, trips: Value, init: &[Value], body: B) -> Result<Vec<Value>>
    where
        B: FnOnce(&mut FnBuilder, Value, &[Value]) -> Result<Vec<Value>>,
    {
        let op = "for_loop_until";
        self.check_operand(op, &trips)?;
        if trips.rank() != 0 || trips.elem() != DType::I32 {
            return Err(err(op, format!("trip count is {}, want tensor<i32>", trips.ty())));
        }
        self.counted_loop(|_| Ok(trips), init, body)
    }

    /// The `while` of a counted loop: `bound` gives the trip count inside the condition region.
    fn counted_loop<N, B>(&mut self, bound: N, init: &[Value], body: B) -> Result<Vec<Value>>
    where
        N: FnOnce(&mut FnBuilder) -> Result<Value>,
        B: FnOnce(&mut FnBuilder, Value, &[Value]) -> Result<Vec<Value>>,
    {
        let zero = self.scalar_i32(0)?;
        let mut all = vec![zero];
        all.extend_from_slice(init);
        let mut outs = self.while_loop(
            &all,
            |b, a| {
                let n = bound(b)?;
                b.compare(Cmp::Lt, a[0], n)
            },
            |b, a| {
                let mut next = body(b, a[0], &a[1..])?;
                let one = b.scalar_i32(1)?;
                let i1 = b.add(a[0], one)?;
                next.insert(0, i1);
                Ok(next)
            },
        )?;
        outs.remove(0);
        Ok(outs)
    }

    /// `func.call @func_name(args)` with the given result types; `Module::add` checks them
    /// against the callee, which must be added to the module first.
    pub fn call(
        &mut self,
        func_name: &str,
        args: &[Value],
        result_types: &[TensorType],
    ) -> Result<Vec<Value>> {
        let op = "call";
        check_symbol(op, func_name)?;
        let attr = format!("callee = @{func_name}");
        let outs = self.push_op(op, "func.call", args, &[], &attr, result_types)?;
        self.calls.push(CallRecord {
            callee: func_name.to_string(),
            args: args.iter().map(Value::ty).collect(),
            results: result_types.to_vec(),
        });
        Ok(outs)
    }

    /// Ends the function with `func.return`; once, at top level. Aliased arguments must match
    /// the type of the result they donate to.
    pub fn ret(&mut self, values: &[Value]) -> Result<()> {
        let op = "ret";
        if self.results.is_some() {
            return Err(err(op, format!("@{} already returned", self.name)));
        }
        if !self.at_top_level() {
            return Err(err(op, "ret inside a region (use the closure's return value)"));
        }
        for v in values {
            self.check_operand(op, v)?;
        }
        let types: Vec<TensorType> = values.iter().map(Value::ty).collect();
        for (arg, alias) in &self.params {
            if let Some(o) = alias {
                if types.get(*o as usize) != Some(&arg.ty()) {
                    return Err(err(
                        op,
                        format!(
                            "argument {arg} ({}) aliases output {o}, which is not of that type",
                            arg.ty()
                        ),
                    ));
                }
            }
        }
        let names: Vec<String> = values.iter().map(Value::name).collect();
        self.push_line(&format!("\"func.return\"({}) : ({}) -> ()", names.join(", "), fmt_types(&types)));
        self.results = Some(types);
        Ok(())
    }
}
