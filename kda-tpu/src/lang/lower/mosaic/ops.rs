//! The Mosaic lowering's rule for each op of a body.

use kda_core::DType;

use super::super::arith::{cast_op, literal, OpRules};
use super::{internal, memref, vty, Emitter};
use crate::error::{Result, TpuError};
use crate::hlo::TensorType;
use crate::lang::ir::{MatPrecision, Op, Reduction, Unary};

impl OpRules for Emitter<'_> {
    /// The Mosaic text of `ProgramId`.
    fn emit_program_id(&mut self, op: &Op) -> Result<()> {
        let Op::ProgramId { out, axis } = op else {
            return Err(internal("ProgramId"));
        };
        self.names.insert(out.id, format!("%g{axis}"));
        Ok(())
    }

    /// The Mosaic text of `ReadTable`.
    fn emit_read_table(&mut self, op: &Op) -> Result<()> {
        let Op::ReadTable { out, table, index } = op else {
            return Err(internal("ReadTable"));
        };
        let (i, t) = (self.name(index)?, self.temp());
        self.line(&format!("{t} = arith.index_cast {i} : i32 to index"));
        let n = self.def(out);
        let ty = memref(&[self.k.tables[*table].1], DType::I32, "smem");
        self.line(&format!("{n} = memref.load %tab{table}[{t}] : {ty}"));
        Ok(())
    }

    /// The Mosaic text of `Splat`.
    fn emit_splat(&mut self, op: &Op) -> Result<()> {
        let Op::Splat { out, value } = op else {
            return Err(internal("Splat"));
        };
        let ty = vty(&out.ty);
        self.splat(out, *value, &ty);
        Ok(())
    }

    /// The Mosaic text of `Load`; a masked load reads the whole window (inside the step's VMEM
    /// block) and selects zero for the rows from the count on.
    fn emit_load(&mut self, op: &Op) -> Result<()> {
        let Op::Load { out, from, offsets, rows } = op else {
            return Err(internal("Load"));
        };
        let idx = self.offsets(offsets)?;
        let (r, rty) = self.reference(*from);
        let ty = vty(&out.ty);
        let Some(rows) = rows else {
            let n = self.def(out);
            self.line(&format!("{n} = vector.load {r}[{idx}] : {rty}, {ty}"));
            return Ok(());
        };
        let ity = vty(&TensorType::new(DType::I32, &out.ty.dims));
        let mty = vty(&TensorType::new(DType::I1, &out.ty.dims));
        let (x, i, c, m, z) = (self.temp(), self.temp(), self.temp(), self.temp(), self.temp());
        let count = self.name(rows)?;
        self.line(&format!("{x} = vector.load {r}[{idx}] : {rty}, {ty}"));
        self.line(&format!("{i} = tpu.iota {{dimensions = array<i32: 0>}} : {ity}"));
        self.line(&format!("{c} = vector.broadcast {count} : i32 to {ity}"));
        self.line(&format!("{m} = arith.cmpi slt, {i}, {c} : {ity}"));
        self.line(&format!("{z} = arith.constant dense<{}> : {ty}", literal(0.0, out.ty.elem)));
        let n = self.def(out);
        self.line(&format!("{n} = arith.select {m}, {x}, {z} : {mty}, {ty}"));
        Ok(())
    }

    /// The Mosaic text of `Store`.
    fn emit_store(&mut self, op: &Op) -> Result<()> {
        let Op::Store { to, offsets, value, rows: None } = op else {
            return Err(internal("Store"));
        };
        let idx = self.offsets(offsets)?;
        let (r, rty) = self.reference(*to);
        let v = self.name(value)?;
        self.line(&format!(
            "tpu.vector_store {r}[{idx}], {v} {{strides = array<i32>}} : {rty}, {},",
            vty(&value.ty)
        ));
        Ok(())
    }

    /// The Mosaic text of `Matmul`.
    fn emit_matmul(&mut self, op: &Op) -> Result<()> {
        let Op::Matmul { out, a, b, contract, precision } = op else {
            return Err(internal("Matmul"));
        };
        let (mut an, mut bn) = (self.name(a)?, self.name(b)?);
        let (mut at, mut bt) = (a.ty.clone(), b.ty.clone());
        // One bf16 pass: f32 operands rounded to bf16 here (as the interpret lowering
        // does), so that the MXU streams packed bf16 rows, half the issue of f32 rows
        // it would round itself.
        if *precision == MatPrecision::Default {
            for (n, t) in [(&mut an, &mut at), (&mut bn, &mut bt)] {
                if t.elem == DType::F32 {
                    let r = self.temp();
                    let bf = TensorType::new(DType::BF16, &t.dims);
                    self.line(&format!("{r} = arith.truncf {n} : {} to {}", vty(t), vty(&bf)));
                    (*n, *t) = (r, bf);
                }
            }
        }
        let z = self.temp();
        self.line(&format!("{z} = arith.constant dense<0.000000000e+00> : {}", vty(&out.ty)));
        let (cl, cr) = (contract.0, contract.1);
        let dims =
            format!("[{cl}], [{cr}], [{}], [{}], [0, {}, 1, {}], [], []", 1 - cl, 1 - cr, 1 - cl, 1 - cr);
        // Every precision but the one bf16 pass is full precision on the MXU.
        let p = match precision {
            MatPrecision::Default => "",
            _ => "precision = #tpu.contract_precision<fp32>, ",
        };
        let n = self.def(out);
        self.line(&format!(
            "{n} = tpu.matmul {an}, {bn}, {z} {{dimension_numbers = #tpu.dot_dimension_numbers<{dims}>, {p}transpose_lhs_hint = false}} : {}, {}, {} -> {}",
            vty(&at), vty(&bt), vty(&out.ty), vty(&out.ty)
        ));
        Ok(())
    }

    /// The Mosaic text of `Binary`.
    fn emit_binary(&mut self, op: &Op) -> Result<()> {
        let Op::Binary { out, op, a, b } = op else {
            return Err(internal("Binary"));
        };
        let ty = vty(&out.ty);
        self.t.binary(out, *op, a, b, &ty)
    }

    /// The Mosaic text of `Unary`.
    fn emit_unary(&mut self, op: &Op) -> Result<()> {
        let Op::Unary { out, op, a } = op else {
            return Err(internal("Unary"));
        };
        let an = self.name(a)?;
        let name = match op {
            Unary::Exp => "math.exp",
            Unary::Exp2 => "math.exp2",
            Unary::Log => "math.log",
            Unary::Log1p => "math.log1p",
            Unary::Rsqrt => "math.rsqrt",
            Unary::Tanh => "math.tanh",
            Unary::Neg => "arith.negf",
        };
        let n = self.def(out);
        self.line(&format!("{n} = {name} {an} : {}", vty(&out.ty)));
        Ok(())
    }

    /// The Mosaic text of `Iota`.
    fn emit_iota(&mut self, op: &Op) -> Result<()> {
        let Op::Iota { out, dim } = op else {
            return Err(internal("Iota"));
        };
        let n = self.def(out);
        self.line(&format!("{n} = tpu.iota {{dimensions = array<i32: {dim}>}} : {}", vty(&out.ty)));
        Ok(())
    }

    /// The Mosaic text of `Compare`.
    fn emit_compare(&mut self, op: &Op) -> Result<()> {
        let Op::Compare { out, cmp, a, b } = op else {
            return Err(internal("Compare"));
        };
        let ty = vty(&a.ty);
        self.t.compare(out, *cmp, a, b, &ty)
    }

    /// The Mosaic text of `Select`.
    fn emit_select(&mut self, op: &Op) -> Result<()> {
        let Op::Select { out, cond, a, b } = op else {
            return Err(internal("Select"));
        };
        let types = (vty(&cond.ty), vty(&out.ty));
        self.t.select(out, cond, a, b, (&types.0, &types.1))
    }

    /// The Mosaic text of `Reduce`.
    fn emit_reduce(&mut self, op: &Op) -> Result<()> {
        let Op::Reduce { out, op, a, axis } = op else {
            return Err(internal("Reduce"));
        };
        let an = self.name(a)?;
        let mut dims = a.ty.dims.clone();
        dims.remove(*axis);
        let reduced = TensorType::new(DType::F32, &dims);
        let (acc, r) = (self.temp(), self.temp());
        let (kind, init) = match op {
            Reduction::Sum => ("add", 0.0),
            Reduction::Max => ("maximumf", f64::NEG_INFINITY),
        };
        self.line(&format!(
            "{acc} = arith.constant dense<{}> : {}",
            literal(init, DType::F32),
            vty(&reduced)
        ));
        self.line(&format!(
            "{r} = vector.multi_reduction <{kind}>, {an}, {acc} [{axis}] : {} to {}",
            vty(&a.ty),
            vty(&reduced)
        ));
        let n = self.def(out);
        self.line(&format!("{n} = vector.shape_cast {r} : {} to {}", vty(&reduced), vty(&out.ty)));
        Ok(())
    }

    /// The Mosaic text of `Cast`.
    fn emit_cast(&mut self, op: &Op) -> Result<()> {
        let Op::Cast { out, a } = op else {
            return Err(internal("Cast"));
        };
        let op = cast_op(a.ty.elem, out.ty.elem);
        self.conversion(op, out, a)?;
        Ok(())
    }

    /// The Mosaic text of `Transpose`.
    fn emit_transpose(&mut self, op: &Op) -> Result<()> {
        let Op::Transpose { out, a } = op else {
            return Err(internal("Transpose"));
        };
        let an = self.name(a)?;
        let n = self.def(out);
        self.line(&format!(
            "{n} = \"tpu.transpose\"({an}) {{permutation = array<i64: 1, 0>}} : ({}) -> {}",
            vty(&a.ty),
            vty(&out.ty)
        ));
        Ok(())
    }

    /// The Mosaic text of `Slice`.
    fn emit_slice(&mut self, op: &Op) -> Result<()> {
        let Op::Slice { out, a, starts } = op else {
            return Err(internal("Slice"));
        };
        let an = self.name(a)?;
        let n = self.def(out);
        let list = |v: &[i64]| v.iter().map(i64::to_string).collect::<Vec<_>>().join(", ");
        let ones = vec![1; starts.len()];
        self.line(&format!(
            "{n} = \"vector.extract_strided_slice\"({an}) {{offsets = [{}], sizes = [{}], strides = [{}]}} : ({}) -> {}",
            list(starts),
            list(&out.ty.dims),
            list(&ones),
            vty(&a.ty),
            vty(&out.ty)
        ));
        Ok(())
    }

    /// The Mosaic text of `Concat`.
    fn emit_concat(&mut self, op: &Op) -> Result<()> {
        let Op::Concat { out, parts, dim } = op else {
            return Err(internal("Concat"));
        };
        let names = parts.iter().map(|p| self.name(p)).collect::<Result<Vec<_>>>()?;
        let tys: Vec<String> = parts.iter().map(|p| vty(&p.ty)).collect();
        let n = self.def(out);
        self.line(&format!(
            "{n} = tpu.concatenate {} in {dim} : {} -> {}",
            names.join(", "),
            tys.join(", "),
            vty(&out.ty)
        ));
        Ok(())
    }

    /// The Mosaic text of `If`.
    fn emit_if(&mut self, op: &Op) -> Result<()> {
        let Op::If { cond, then } = op else {
            return Err(internal("If"));
        };
        let c = self.name(cond)?;
        self.line(&format!("scf.if {c} {{"));
        self.depth += 1;
        let saved = self.names.clone();
        self.ops(then)?;
        self.names = saved;
        self.depth -= 1;
        self.line("}");
        Ok(())
    }

    /// The Mosaic text of `For`.
    fn emit_for(&mut self, op: &Op) -> Result<()> {
        let Op::For { lo, hi, until, index, init, args, body, yields, outs, .. } = op else {
            return Err(internal("For"));
        };
        let (l, mut h, s) = (self.temp(), self.temp(), self.temp());
        self.line(&format!("{l} = arith.constant {lo} : i32"));
        self.line(&format!("{h} = arith.constant {hi} : i32"));
        self.line(&format!("{s} = arith.constant 1 : i32"));
        if let Some(u) = until {
            let (u, m) = (self.name(u)?, self.temp());
            self.line(&format!("{m} = arith.minsi {h}, {u} : i32"));
            h = m;
        }
        let inits = init.iter().map(|v| self.name(v)).collect::<Result<Vec<_>>>()?;
        let types: Vec<String> = init.iter().map(|v| vty(&v.ty)).collect();
        let r = self.temp();
        let lhs = match outs.len() {
            0 => String::new(),
            1 => format!("{r} = "),
            n => format!("{r}:{n} = "),
        };
        let operands = [l, h, s].into_iter().chain(inits).collect::<Vec<_>>().join(", ");
        self.line(&format!("{lhs}\"scf.for\"({operands}) ({{"));
        let saved = self.names.clone();
        let i = self.def(index);
        let mut block_args = vec![format!("{i}: i32")];
        for a in args {
            let n = self.def(a);
            block_args.push(format!("{n}: {}", vty(&a.ty)));
        }
        self.line(&format!("^bb0({}):", block_args.join(", ")));
        self.depth += 1;
        self.ops(body)?;
        let ys = yields.iter().map(|v| self.name(v)).collect::<Result<Vec<_>>>()?;
        self.line(&format!("\"scf.yield\"({}) : ({}) -> ()", ys.join(", "), types.join(", ")));
        self.depth -= 1;
        self.names = saved;
        let result = match types.len() {
            1 => types[0].clone(),
            _ => format!("({})", types.join(", ")),
        };
        let all: Vec<String> =
            ["i32".to_string(), "i32".into(), "i32".into()].into_iter().chain(types.clone()).collect();
        self.line(&format!("}}) : ({}) -> {result}", all.join(", ")));
        for (k, o) in outs.iter().enumerate() {
            let name = if outs.len() == 1 { r.clone() } else { format!("{r}#{k}") };
            self.names.insert(o.id, name);
        }
        Ok(())
    }

    /// The text of an `Op::Broadcast`.
    fn emit_broadcast(&mut self, op: &Op) -> Result<()> {
        let Op::Broadcast { out, a } = op else {
            return Err(internal("Broadcast"));
        };
        self.conversion("vector.broadcast", out, a)
    }

    /// The text of an `Op::Reshape`.
    fn emit_reshape(&mut self, op: &Op) -> Result<()> {
        let Op::Reshape { out, a } = op else {
            return Err(internal("Reshape"));
        };
        self.conversion("vector.shape_cast", out, a)
    }

    /// A cumsum has no Mosaic form (the lowering's check refuses it first).
    fn emit_cumsum(&mut self, _op: &Op) -> Result<()> {
        Err(TpuError::unsupported("mosaic lowering", super::CUMSUM_REFUSED))
    }
}
