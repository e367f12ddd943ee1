//! The Triton lowering's rule for each op of a body.

use std::collections::BTreeSet;

use kda_core::DType;

use super::super::arith::{cast_op, literal, OpRules};
use super::F32Dot;
use super::{elem, padded, tty, vty, written, Emitter};
use crate::error::{Result, TpuError};
use crate::lang::ir::{MatPrecision, Op, Place, Reduction, Unary};

/// The error of an op method handed another op (a dispatch mistake, never the user's).
fn internal(kind: &str) -> TpuError {
    TpuError::builder("triton lowering", format!("internal: not a {kind} op"))
}

impl OpRules for Emitter<'_> {
    /// The TTIR of `ProgramId`.
    fn emit_program_id(&mut self, op: &Op) -> Result<()> {
        let Op::ProgramId { out, axis } = op else {
            return Err(internal("ProgramId"));
        };
        let g = self.grid[*axis].clone();
        self.names.insert(out.id, g);
        Ok(())
    }

    /// The TTIR of `ReadTable`.
    fn emit_read_table(&mut self, op: &Op) -> Result<()> {
        let Op::ReadTable { out, table, index } = op else {
            return Err(internal("ReadTable"));
        };
        let i = self.name(index)?;
        let r = self.table_entry(*table, &i);
        self.names.insert(out.id, r);
        Ok(())
    }

    /// The TTIR of `Splat`.
    fn emit_splat(&mut self, op: &Op) -> Result<()> {
        let Op::Splat { out, value } = op else {
            return Err(internal("Splat"));
        };
        let ty = vty(out);
        self.splat(out, *value, &ty);
        Ok(())
    }

    /// The TTIR of `Load`.
    fn emit_load(&mut self, op: &Op) -> Result<()> {
        let Op::Load { out, from, offsets, rows } = op else {
            return Err(internal("Load"));
        };
        match from.place {
            Place::Scratch(i) => {
                let s = self.scratch[i].clone();
                self.names.insert(out.id, s);
            }
            _ => {
                let (ptrs, pty, mask) = self.window(*from, offsets, &out.ty.dims)?;
                let mask = self.with_rows(mask, &out.ty.dims, rows.as_ref())?;
                let n = self.def(out);
                match mask {
                    None => self.line(&format!("{n} = tt.load {ptrs} : {pty}")),
                    Some(m) => {
                        let z = self.let_(&format!(
                            "arith.constant dense<{}> : {}",
                            literal(0.0, out.ty.elem),
                            vty(out)
                        ));
                        self.line(&format!("{n} = tt.load {ptrs}, {m}, {z} : {pty}"));
                    }
                }
            }
        }
        Ok(())
    }

    /// The TTIR of `Store`.
    fn emit_store(&mut self, op: &Op) -> Result<()> {
        let Op::Store { to, offsets, value, rows } = op else {
            return Err(internal("Store"));
        };
        let v = self.name(value)?;
        match to.place {
            Place::Scratch(i) => self.scratch[i] = v,
            _ => {
                let (ptrs, pty, mask) = self.window(*to, offsets, &value.ty.dims)?;
                let mask = self.with_rows(mask, &value.ty.dims, rows.as_ref())?;
                match mask {
                    None => self.line(&format!("tt.store {ptrs}, {v} : {pty}")),
                    Some(m) => self.line(&format!("tt.store {ptrs}, {v}, {m} : {pty}")),
                }
            }
        }
        Ok(())
    }

    /// The TTIR of `Matmul`.
    fn emit_matmul(&mut self, op: &Op) -> Result<()> {
        let Op::Matmul { out, a, b, contract, precision } = op else {
            return Err(internal("Matmul"));
        };
        let (mut an, mut bn) = (self.name(a)?, self.name(b)?);
        let (mut ad, mut bd) = (a.ty.dims.clone(), b.ty.dims.clone());
        let e = a.ty.elem;
        // Contracting dim padded: zero it on both sides.
        an = self.fill_padding(&an, &ad, e, contract.0, 0.0);
        bn = self.fill_padding(&bn, &bd, e, contract.1, 0.0);
        // Operands as tt.dot takes them, [M, K] x [K, N]; f32 at `Default` in bf16.
        let bf16 = e == DType::F32 && *precision == MatPrecision::Default;
        for (x, dims, transposed) in
            [(&mut an, &mut ad, contract.0 == 0), (&mut bn, &mut bd, contract.1 == 1)]
        {
            if transposed {
                *x = self.trans(x, dims, e);
                *dims = vec![dims[1], dims[0]];
            }
            if bf16 {
                let (f, h) = (tty(&padded(dims), "f32"), tty(&padded(dims), "bf16"));
                *x = self.let_(&format!("arith.truncf {x} : {f} to {h}"));
            }
        }
        let oe = if bf16 { DType::BF16 } else { e };
        let acc = self.let_(&format!("arith.constant dense<0.000000000e+00> : {}", vty(out)));
        let p = match (oe, precision, self.params.f32_dot) {
            (DType::F32, MatPrecision::Highest, F32Dot::Ieee) | (DType::F32, MatPrecision::Ieee, _) => {
                ", inputPrecision = ieee"
            }
            (DType::F32, MatPrecision::Highest, F32Dot::Tf32x3) | (DType::F32, MatPrecision::Tf32x3, _) => {
                ", inputPrecision = tf32x3"
            }
            (DType::F32, MatPrecision::Tf32, _) => ", inputPrecision = tf32",
            (DType::F32, MatPrecision::Bf16x3, _) => ", inputPrecision = bf16x3",
            _ => "",
        };
        let (at, bt) = (tty(&padded(&ad), elem(oe)), tty(&padded(&bd), elem(oe)));
        let n = self.def(out);
        self.line(&format!("{n} = tt.dot {an}, {bn}, {acc}{p} : {at} * {bt} -> {}", vty(out)));
        Ok(())
    }

    /// The TTIR of `Binary`.
    fn emit_binary(&mut self, op: &Op) -> Result<()> {
        let Op::Binary { out, op, a, b } = op else {
            return Err(internal("Binary"));
        };
        let ty = vty(out);
        self.t.binary(out, *op, a, b, &ty)
    }

    /// The TTIR of `Unary`.
    fn emit_unary(&mut self, op: &Op) -> Result<()> {
        let Op::Unary { out, op, a } = op else {
            return Err(internal("Unary"));
        };
        let an = self.name(a)?;
        let r = if a.ty.elem == DType::F32 || *op == Unary::Neg {
            self.unary_f32(*op, &an, &vty(a))
        } else {
            let p = padded(&a.ty.dims);
            let (h, f) = (vty(a), tty(&p, "f32"));
            let wide = self.let_(&format!("arith.extf {an} : {h} to {f}"));
            let r = self.unary_f32(*op, &wide, &f);
            self.let_(&format!("arith.truncf {r} : {f} to {h}"))
        };
        self.names.insert(out.id, r);
        Ok(())
    }

    /// The TTIR of `Iota`.
    fn emit_iota(&mut self, op: &Op) -> Result<()> {
        let Op::Iota { out, dim } = op else {
            return Err(internal("Iota"));
        };
        let r = self.iota(&padded(&out.ty.dims), *dim);
        self.names.insert(out.id, r);
        Ok(())
    }

    /// The TTIR of `Compare`.
    fn emit_compare(&mut self, op: &Op) -> Result<()> {
        let Op::Compare { out, cmp, a, b } = op else {
            return Err(internal("Compare"));
        };
        let ty = vty(a);
        self.t.compare(out, *cmp, a, b, &ty)
    }

    /// The TTIR of `Select`.
    fn emit_select(&mut self, op: &Op) -> Result<()> {
        let Op::Select { out, cond, a, b } = op else {
            return Err(internal("Select"));
        };
        let types = (vty(cond), vty(out));
        self.t.select(out, cond, a, b, (&types.0, &types.1))
    }

    /// The TTIR of `Reduce`.
    fn emit_reduce(&mut self, op: &Op) -> Result<()> {
        let Op::Reduce { out, op, a, axis } = op else {
            return Err(internal("Reduce"));
        };
        let an = self.name(a)?;
        let (kind, init) = match op {
            Reduction::Sum => ("arith.addf", 0.0),
            Reduction::Max => ("arith.maximumf", f64::NEG_INFINITY),
        };
        let x = self.fill_padding(&an, &a.ty.dims, DType::F32, *axis, init);
        let p = padded(&a.ty.dims);
        let mut reduced = p.clone();
        reduced.remove(*axis);
        let r = self.reduce(&x, &p, *axis, "f32", kind);
        let n = self.def(out);
        self.line(&format!(
            "{n} = tt.expand_dims {r} {{axis = {axis} : i32}} : {} -> {}",
            tty(&reduced, "f32"),
            vty(out)
        ));
        Ok(())
    }

    /// The TTIR of `Broadcast`.
    fn emit_broadcast(&mut self, op: &Op) -> Result<()> {
        let Op::Broadcast { out, a } = op else {
            return Err(internal("Broadcast"));
        };
        let an = self.name(a)?;
        let to = padded(&out.ty.dims);
        let e = elem(a.ty.elem);
        let r = if a.ty.dims.is_empty() {
            self.let_(&format!("tt.splat {an} : {e} -> {}", tty(&to, e)))
        } else {
            let mut cur = an;
            let mut shape = padded(&a.ty.dims);
            while shape.len() < to.len() {
                let next: Vec<i64> = std::iter::once(1).chain(shape.iter().copied()).collect();
                cur = self.let_(&format!(
                    "tt.expand_dims {cur} {{axis = 0 : i32}} : {} -> {}",
                    tty(&shape, e),
                    tty(&next, e)
                ));
                shape = next;
            }
            if shape != to {
                cur = self.let_(&format!("tt.broadcast {cur} : {} -> {}", tty(&shape, e), tty(&to, e)));
            }
            cur
        };
        self.names.insert(out.id, r);
        Ok(())
    }

    /// The TTIR of `Cast`.
    fn emit_cast(&mut self, op: &Op) -> Result<()> {
        let Op::Cast { out, a } = op else {
            return Err(internal("Cast"));
        };
        let op = cast_op(a.ty.elem, out.ty.elem);
        let an = self.name(a)?;
        let n = self.def(out);
        self.line(&format!("{n} = {op} {an} : {} to {}", vty(a), vty(out)));
        Ok(())
    }

    /// The TTIR of `Transpose`.
    fn emit_transpose(&mut self, op: &Op) -> Result<()> {
        let Op::Transpose { out, a } = op else {
            return Err(internal("Transpose"));
        };
        let an = self.name(a)?;
        let r = self.trans(&an, &a.ty.dims, a.ty.elem);
        self.names.insert(out.id, r);
        Ok(())
    }

    /// The TTIR of `Reshape`.
    fn emit_reshape(&mut self, op: &Op) -> Result<()> {
        let Op::Reshape { out, a } = op else {
            return Err(internal("Reshape"));
        };
        let an = self.name(a)?;
        let n = self.def(out);
        self.line(&format!("{n} = tt.reshape {an} : {} -> {}", vty(a), vty(out)));
        Ok(())
    }

    /// The TTIR of `Slice`.
    fn emit_slice(&mut self, op: &Op) -> Result<()> {
        let Op::Slice { out, a, starts } = op else {
            return Err(internal("Slice"));
        };
        let mut cur = self.name(a)?;
        let mut dims = padded(&a.ty.dims);
        let e = a.ty.elem;
        for d in 0..dims.len() {
            let s = out.ty.dims[d];
            if s == a.ty.dims[d] {
                continue;
            }
            // [.., D, ..] -> [.., D/s, s, ..], keep block starts[d]/s of the new axis.
            let mut split = dims.clone();
            split[d] = dims[d] / s;
            split.insert(d + 1, s);
            let (from, to) = (tty(&dims, elem(e)), tty(&split, elem(e)));
            let r = self.let_(&format!("tt.reshape {cur} : {from} -> {to}"));
            cur = self.pick(&r, &split, d, starts[d] / s, e);
            dims[d] = s;
        }
        self.names.insert(out.id, cur);
        Ok(())
    }

    /// The TTIR of `Concat`.
    fn emit_concat(&mut self, op: &Op) -> Result<()> {
        let Op::Concat { out, parts, dim } = op else {
            return Err(internal("Concat"));
        };
        let e = out.ty.elem;
        let d = *dim;
        let pd = padded(&parts[0].ty.dims);
        let n = parts.len() as i64;
        let mut stacked = pd.clone();
        stacked.insert(d, n);
        let st = tty(&stacked, elem(e));
        let mut acc = self.let_(&format!("arith.constant dense<{}> : {st}", literal(0.0, e)));
        for (j, part) in parts.iter().enumerate() {
            let pn = self.name(part)?;
            let mut one = pd.clone();
            one.insert(d, 1);
            let x = self.let_(&format!(
                "tt.expand_dims {pn} {{axis = {d} : i32}} : {} -> {}",
                tty(&pd, elem(e)),
                tty(&one, elem(e))
            ));
            let x = self.let_(&format!("tt.broadcast {x} : {} -> {st}", tty(&one, elem(e))));
            let m = self.index_test(&stacked, d, "eq", j as i64);
            acc = self.let_(&format!("arith.select {m}, {x}, {acc} : {}, {st}", tty(&stacked, "i1")));
        }
        let r = self.let_(&format!("tt.reshape {acc} : {st} -> {}", vty(out)));
        self.names.insert(out.id, r);
        Ok(())
    }

    /// The TTIR of `If`.
    fn emit_if(&mut self, op: &Op) -> Result<()> {
        let Op::If { cond, then } = op else {
            return Err(internal("If"));
        };
        let c = self.name(cond)?;
        let mut w = BTreeSet::new();
        written(then, &mut w);
        let w: Vec<usize> = w.into_iter().collect();
        let before = self.scratch.clone();
        let types: Vec<String> = w.iter().map(|&i| self.scratch_type(i)).collect();
        let r = self.temp();
        if w.is_empty() {
            self.line(&format!("scf.if {c} {{"));
        } else {
            let lhs = if w.len() == 1 { r.clone() } else { format!("{r}:{}", w.len()) };
            self.line(&format!("{lhs} = scf.if {c} -> ({}) {{", types.join(", ")));
        }
        self.depth += 1;
        let saved = self.names.clone();
        self.ops(then)?;
        self.names = saved;
        if !w.is_empty() {
            let ys: Vec<String> = w.iter().map(|&i| self.scratch[i].clone()).collect();
            self.line(&format!("scf.yield {} : {}", ys.join(", "), types.join(", ")));
            self.depth -= 1;
            self.line("} else {");
            self.depth += 1;
            let olds: Vec<String> = w.iter().map(|&i| before[i].clone()).collect();
            self.line(&format!("scf.yield {} : {}", olds.join(", "), types.join(", ")));
        }
        self.depth -= 1;
        self.line("}");
        self.scratch = before;
        for (k, &i) in w.iter().enumerate() {
            self.scratch[i] = if w.len() == 1 { r.clone() } else { format!("{r}#{k}") };
        }
        Ok(())
    }

    /// The TTIR of `For`.
    fn emit_for(&mut self, op: &Op) -> Result<()> {
        let Op::For { lo, hi, until, index, init, args, body, yields, outs, .. } = op else {
            return Err(internal("For"));
        };
        let until = until.as_ref().map(|u| self.name(u)).transpose()?;
        let mut w = BTreeSet::new();
        written(body, &mut w);
        let w: Vec<usize> = w.into_iter().collect();
        let inits = init.iter().map(|v| self.name(v)).collect::<Result<Vec<_>>>()?;
        let saved = self.names.clone();
        let arg_names: Vec<String> = args.iter().map(|a| self.def(a)).collect();
        let i = self.def(index);
        let yields_outs = self.counted_loop(
            *lo,
            (*hi, until.as_deref()),
            &i,
            &inits,
            &arg_names,
            &init.iter().map(vty).collect::<Vec<_>>(),
            &w,
            |e| {
                e.ops(body)?;
                yields.iter().map(|v| e.name(v)).collect()
            },
        )?;
        self.names = saved;
        for (o, name) in outs.iter().zip(yields_outs) {
            self.names.insert(o.id, name);
        }
        Ok(())
    }

    /// `tt.scan` along the axis, the padding zero first; the exclusive form subtracts each
    /// element after (exact: it is the inclusive sum's last term); segments scan (value, start
    /// flag) pairs that restart at each flag. Reverse scans with segments are refused in the
    /// check.
    fn emit_cumsum(&mut self, op: &Op) -> Result<()> {
        let Op::Cumsum { out, a, axis, scan, starts } = op else {
            return Err(internal("Cumsum"));
        };
        let an = self.name(a)?;
        let x = self.fill_padding(&an, &a.ty.dims, DType::F32, *axis, 0.0);
        let p = padded(&a.ty.dims);
        let (f, i) = (tty(&p, "f32"), tty(&p, "i32"));
        let attrs = format!("axis = {axis} : i32, reverse = {}", scan.reverse);
        let sums = match starts {
            None => self.combining("tt.scan", &x, &attrs, ("f32", "arith.addf"), (&f, &f)),
            Some(st) => {
                let r = self.temp();
                let sn = self.name(st)?;
                let flags = self.let_(&format!("arith.extui {sn} : {} to {i}", tty(&p, "i1")));
                let (av, af, bv, bf) = (self.temp(), self.temp(), self.temp(), self.temp());
                let (zero, sum, restart, v, o) =
                    (self.temp(), self.temp(), self.temp(), self.temp(), self.temp());
                self.line(&format!("{r}:2 = \"tt.scan\"({x}, {flags}) <{{{attrs}}}> ({{"));
                self.line(&format!("^bb0({av}: f32, {af}: i32, {bv}: f32, {bf}: i32):"));
                self.depth += 1;
                self.line(&format!("{zero} = arith.constant 0 : i32"));
                self.line(&format!("{sum} = arith.addf {av}, {bv} : f32"));
                self.line(&format!("{restart} = arith.cmpi ne, {bf}, {zero} : i32"));
                self.line(&format!("{v} = arith.select {restart}, {bv}, {sum} : f32"));
                self.line(&format!("{o} = arith.ori {af}, {bf} : i32"));
                self.line(&format!("tt.scan.return {v}, {o} : f32, i32"));
                self.depth -= 1;
                self.line(&format!("}}) : ({f}, {i}) -> ({f}, {i})"));
                format!("{r}#0")
            }
        };
        if scan.exclusive {
            let n = self.def(out);
            self.line(&format!("{n} = arith.subf {sums}, {x} : {f}"));
        } else {
            self.names.insert(out.id, sums);
        }
        Ok(())
    }
}
