//! The Mosaic lowering: a [`Kernel`] as the MLIR text of a Mosaic TPU kernel (plain `tpu`,
//! `arith`, `vector`, `scf`, `math` and `memref` ops, no serialization), and that kernel as a
//! `stablehlo.custom_call @tpu_custom_call` inside a caller's StableHLO function, which libtpu
//! compiles (the contract: `docs/design.md`, Mosaic kernels).

use std::fmt::Write;

use kda_core::DType;

mod ops;
mod schedule;

use super::arith::{derefs_to_text, OpRules, Text};
use super::{custom_call_layouts, quoted_error, refuse, Lower};
use crate::error::{Result, TpuError};
use crate::hlo::{FnBuilder, TensorType, Value};
use crate::lang::ir::{Offset, Op, Place, Ref, V};
use crate::lang::kernel::{Index, Kernel, Operand, Semantics};
use crate::lang::OpKind;

fn vty(t: &TensorType) -> String {
    if t.dims.is_empty() {
        t.elem.name().to_string()
    } else {
        let d: Vec<String> = t.dims.iter().map(i64::to_string).collect();
        format!("vector<{}x{}>", d.join("x"), t.elem.name())
    }
}

fn memref(dims: &[i64], dtype: DType, space: &str) -> String {
    let d: Vec<String> = dims.iter().map(i64::to_string).collect();
    format!("memref<{}x{}, #tpu.memory_space<{space}>>", d.join("x"), dtype.name())
}

/// Standard base64 (RFC 4648, with padding) of `bytes`.
pub(crate) fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let n = chunk.iter().enumerate().fold(0u32, |n, (i, &b)| n | (u32::from(b) << (16 - 8 * i)));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// Why the Mosaic lowering refuses a cumsum.
const CUMSUM_REFUSED: &str =
    "a cumsum (no scan in this lowering: write a prefix sum as a product with a triangular mask)";

/// Why the Mosaic lowering refuses a masked store.
const MASKED_REFUSED: &str = "a masked store (`store_rows`: a Mosaic block is written back whole, \
     with no rows left out)";

/// The Mosaic lowering: a kernel as a Mosaic TPU kernel inside a `tpu_custom_call`, for
/// libtpu. Reads each kernel's [`MosaicParams`] (defaults where it has none).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Mosaic;

/// What the Mosaic lowering reads of a kernel beyond its definition
/// ([`crate::lang::KernelBuilder::params`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct MosaicParams {
    /// The scoped VMEM the TPU compiler may give the kernel (its blocks, scratch and spills),
    /// for a kernel that needs more than the generation's default (16 MiB on v5e, the
    /// smallest); `None`: the default.
    pub vmem_limit: Option<i64>,
    /// The block rule the kernel's operands must meet.
    pub tiling: Tiling,
    /// The order the body's ops are written in.
    pub schedule: Schedule,
}

impl Default for MosaicParams {
    /// The compiler's default VMEM, the TPU's tiling, the list schedule.
    fn default() -> Self {
        MosaicParams { vmem_limit: None, tiling: Tiling::default(), schedule: Schedule::List }
    }
}

impl MosaicParams {
    /// The same parameters with a scoped VMEM limit of `bytes`; refused unless positive.
    pub fn with_vmem_limit(mut self, bytes: i64) -> Result<Self> {
        if bytes <= 0 {
            return Err(TpuError::builder("mosaic params", format!("a vmem limit of {bytes} bytes")));
        }
        self.vmem_limit = Some(bytes);
        Ok(self)
    }
    /// The same parameters with the ops written in `schedule`'s order.
    pub fn with_schedule(mut self, schedule: Schedule) -> Self {
        self.schedule = schedule;
        self
    }
}

/// Mosaic's block rule: each of a block's last two dims is a multiple of the tiling (lanes on
/// the last, sublanes of the element width on the one before) or the array's full dim.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Tiling {
    /// Lanes of a vector register (the last dim).
    pub lanes: i64,
    /// Sublanes of 32-bit elements (the second-to-last dim).
    pub sublanes_32bit: i64,
    /// Sublanes of 16-bit elements, two packed per 32-bit sublane.
    pub sublanes_16bit: i64,
}

impl Default for Tiling {
    /// The TPU's (8, 128) tiling of 32-bit types, (16, 128) of 16-bit ones.
    fn default() -> Self {
        Tiling { lanes: 128, sublanes_32bit: 8, sublanes_16bit: 16 }
    }
}

impl Tiling {
    /// Where `o`'s block breaks the rule, if it does.
    fn off(&self, o: &Operand) -> Option<String> {
        let r = o.ty.dims.len();
        let sub = if o.ty.elem.bit_width() == 16 { self.sublanes_16bit } else { self.sublanes_32bit };
        let tiles = if r >= 2 { vec![(r - 2, sub), (r - 1, self.lanes)] } else { vec![(0, self.lanes)] };
        tiles.into_iter().find_map(|(axis, t)| {
            let (b, d) = (o.block[axis], o.ty.dims[axis]);
            (b != d && b % t != 0).then(|| {
                format!(
                    "block {:?} of {}: dim {axis} must be a multiple of {t} or the full {d}",
                    o.block, o.ty
                )
            })
        })
    }
}

/// The order the Mosaic lowering writes a body's ops in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Schedule {
    /// A list schedule on a model of a TensorCore (`schedule.rs`): each step's independent
    /// work fills the waits on its products.
    List,
    /// The list schedule with at most about `ahead` of a body's `of` chunks in flight: an op
    /// more than `ahead / of` of the body's ops past the first op not yet placed waits while a
    /// nearer one is ready. Fewer values are live at once for libtpu to spill, at the price of
    /// less independent work to fill each wait (docs/kernels/op-order.md).
    Windowed {
        /// Chunks in flight.
        ahead: u32,
        /// Chunks of the body.
        of: u32,
    },
    /// The order the body was built in.
    Built,
}

impl Mosaic {
    fn params(kernel: &Kernel) -> MosaicParams {
        kernel.params::<MosaicParams>().copied().unwrap_or_default()
    }
}

impl Lower for Mosaic {
    fn name(&self) -> &str {
        "mosaic"
    }
    /// Refuses blocks off the tiling and a VMEM limit below one byte.
    fn check(&self, kernel: &Kernel) -> Result<()> {
        let params = Mosaic::params(kernel);
        if let Some(bytes) = params.vmem_limit.filter(|&b| b <= 0) {
            return Err(refuse(self, kernel, format!("a vmem limit of {bytes} bytes")));
        }
        let (mut scans, mut masked) = (false, false);
        kernel.walk(&mut |kind| {
            scans |= kind == OpKind::Cumsum;
            masked |= kind == OpKind::StoreRows;
        });
        if scans {
            return Err(refuse(self, kernel, CUMSUM_REFUSED));
        }
        if masked {
            return Err(refuse(self, kernel, MASKED_REFUSED));
        }
        for o in kernel.inputs.iter().chain(&kernel.outputs) {
            if let Some(why) = params.tiling.off(o) {
                return Err(refuse(
                    self,
                    kernel,
                    format!("a block off the TPU's tiling: `{}`: {why}", o.name),
                ));
            }
        }
        Ok(())
    }
    /// The text of a Mosaic module: the kernel function and one transform function per
    /// operand and result.
    fn text(&self, kernel: &Kernel) -> Result<String> {
        self.check(kernel)?;
        text(kernel, &Mosaic::params(kernel))
    }
    /// A `tpu_custom_call` that libtpu compiles.
    fn call(&self, kernel: &Kernel, f: &mut FnBuilder, operands: &[Value]) -> Result<Vec<Value>> {
        call(kernel, &Mosaic::params(kernel), f, operands)
    }
    /// Quotes the body line the compiler points at (`loc("-":LINE:COL)`), so the message shows
    /// the op libtpu refused.
    fn explain(&self, kernel: &Kernel, error: TpuError) -> TpuError {
        quoted_error(error, kernel, self.text(kernel).ok(), "loc(\"-\":", "body: ")
    }
}

/// The error of an op method handed another op (a dispatch mistake, never the user's).
fn internal(kind: &str) -> TpuError {
    TpuError::builder("mosaic lowering", format!("internal: not a {kind} op"))
}

struct Emitter<'k> {
    k: &'k Kernel,
    t: Text,
}

derefs_to_text!(Emitter);

impl<'k> Emitter<'k> {
    fn reference(&self, r: Ref) -> (String, String) {
        let (name, dims, dtype) = match r.place {
            Place::Input(i) => (format!("%in{i}"), self.k.inputs[i].block.clone(), self.k.inputs[i].ty.elem),
            Place::Output(i) => {
                (format!("%out{i}"), self.k.outputs[i].block.clone(), self.k.outputs[i].ty.elem)
            }
            Place::Scratch(i) => {
                (format!("%s{i}"), self.k.scratch[i].1.dims.clone(), self.k.scratch[i].1.elem)
            }
        };
        (name, memref(&dims, dtype, "vmem"))
    }
    fn offsets(&mut self, offsets: &[Offset]) -> Result<String> {
        let mut names = Vec::new();
        for o in offsets {
            let t = self.temp();
            match o {
                Offset::Const(c) => self.line(&format!("{t} = arith.constant {c} : index")),
                Offset::Dyn(v, m) => {
                    let (a, n) = (self.temp(), self.name(v)?);
                    self.line(&format!(
                        "{a} = \"tpu.assume_multiple\"({n}) {{multiple = {m} : i32}} : (i32) -> i32"
                    ));
                    self.line(&format!("{t} = arith.index_cast {a} : i32 to index"));
                }
            }
            names.push(t);
        }
        Ok(names.join(", "))
    }

    /// `out = op a : A to OUT`, the form of the shape and type conversions.
    fn conversion(&mut self, op: &str, out: &V, a: &V) -> Result<()> {
        let an = self.name(a)?;
        let n = self.def(out);
        self.line(&format!("{n} = {op} {an} : {} to {}", vty(&a.ty), vty(&out.ty)));
        Ok(())
    }

    fn ops(&mut self, ops: &[Op]) -> Result<()> {
        for op in ops {
            self.op(op)?;
        }
        Ok(())
    }

    fn index(&mut self, e: &Index) -> String {
        match e {
            Index::Grid(a) => format!("%g{a}"),
            Index::Const(c) => {
                let t = self.temp();
                self.line(&format!("{t} = arith.constant {c} : i32"));
                t
            }
            Index::Add(a, b) => {
                let (a, b) = (self.index(a), self.index(b));
                let t = self.temp();
                self.line(&format!("{t} = arith.addi {a}, {b} : i32"));
                t
            }
            Index::Mul(a, k) => {
                let a = self.index(a);
                let (c, t) = (self.temp(), self.temp());
                self.line(&format!("{c} = arith.constant {k} : i32"));
                self.line(&format!("{t} = arith.muli {a}, {c} : i32"));
                t
            }
            Index::Table(tab, at) => {
                let tab = tab.index;
                let at = self.index(at);
                let (i, t) = (self.temp(), self.temp());
                self.line(&format!("{i} = arith.index_cast {at} : i32 to index"));
                let ty = memref(&[self.k.tables[tab].1], DType::I32, "smem");
                self.line(&format!("{t} = memref.load %tab{tab}[{i}] : {ty}"));
                t
            }
        }
    }
}

/// The kernel as the text of a Mosaic module: the kernel function and one transform
/// function per operand and result.
fn text(k: &Kernel, params: &MosaicParams) -> Result<String> {
    let mut e = Emitter { k, t: Text::new("mosaic text") };
    let grid_args: Vec<String> = (0..k.grid.len()).map(|a| format!("%g{a}: i32")).collect();
    let table_args: Vec<String> = k
        .tables
        .iter()
        .enumerate()
        .map(|(t, (_, n))| format!("%tab{t}: {}", memref(&[*n], DType::I32, "smem")))
        .collect();
    let mut args = grid_args.clone();
    args.extend(table_args.clone());
    for (i, o) in k.inputs.iter().enumerate() {
        args.push(format!("%in{i}: {}", memref(&o.block, o.ty.elem, "vmem")));
    }
    for (i, o) in k.outputs.iter().enumerate() {
        args.push(format!("%out{i}: {}", memref(&o.block, o.ty.elem, "vmem")));
    }
    for (i, (_, t)) in k.scratch.iter().enumerate() {
        args.push(format!("%s{i}: {}", memref(&t.dims, t.elem, "vmem")));
    }
    let semantics: Vec<String> = k
        .grid
        .iter()
        .map(|(_, s)| {
            let s = match s {
                Semantics::Parallel => "parallel",
                Semantics::Arbitrary => "arbitrary",
            };
            format!("#tpu.dimension_semantics<{s}>")
        })
        .collect();
    let bounds: Vec<String> = k.grid.iter().map(|(n, _)| n.to_string()).collect();
    let windows = window_params(k);
    let _ = writeln!(e.out, "module @{} {{", k.name);
    e.depth = 1;
    e.line(&format!(
        "func.func @{}({}) attributes {{dimension_semantics = [{}], iteration_bounds = array<i64: {}>, scalar_prefetch = {} : i64, scratch_operands = {} : i64, tpu.core_type = #tpu.core_type<tc>, window_params = [{}]}} {{",
        k.name,
        args.join(", "),
        semantics.join(", "),
        bounds.join(", "),
        k.tables.len(),
        k.scratch.len(),
        windows.join(", ")
    ));
    e.depth = 2;
    let ordered;
    let ops = match params.schedule {
        Schedule::List => {
            ordered = schedule::schedule(&k.body, None);
            &ordered
        }
        Schedule::Windowed { ahead, of } => {
            ordered = schedule::schedule(&k.body, Some((ahead, of)));
            &ordered
        }
        Schedule::Built => &k.body,
    };
    e.ops(ops)?;
    e.line("return");
    e.depth = 1;
    e.line("}");
    let mut map_args = grid_args;
    map_args.extend(table_args);
    for (i, o) in k.inputs.iter().chain(&k.outputs).enumerate() {
        let ret = vec!["i32"; o.map.len()].join(", ");
        e.line(&format!("func.func @{}_map{i}({}) -> ({ret}) {{", k.name, map_args.join(", ")));
        e.depth = 2;
        let vals: Vec<String> = o.map.iter().map(|m| e.index(m)).collect();
        e.line(&format!("return {} : {ret}", vals.join(", ")));
        e.depth = 1;
        e.line("}");
    }
    e.out.push_str("}\n");
    Ok(e.t.out)
}

/// The kernel's `window_params`: per operand and result its block and transform function.
fn window_params(k: &Kernel) -> Vec<String> {
    let operands = k.inputs.iter().chain(&k.outputs).enumerate();
    operands
        .map(|(i, o)| {
            let b: Vec<String> = o.block.iter().map(i64::to_string).collect();
            format!(
                "{{transform_indices = @{}_map{i}, window_bounds = array<i64: {}>}}",
                k.name,
                b.join(", ")
            )
        })
        .collect()
}

/// The `backend_config` of the custom call: the base64 body, layout passes on, the
/// analytic cost when the kernel has one, and its scoped VMEM limit when it sets one
/// (`scoped_memory_configs`, memory space 1: VMEM).
fn backend_config(k: &Kernel, params: &MosaicParams) -> Result<String> {
    let body = base64(text(k, params)?.as_bytes());
    let cost = k.cost.map_or(String::new(), |c| {
        format!(
            ", \\\"cost_estimate\\\": {{\\\"flops\\\": {}, \\\"transcendentals\\\": {}, \\\"bytes_accessed\\\": {}}}",
            c.flops.round() as u64,
            c.transcendentals.round() as u64,
            c.bytes.round() as u64
        )
    });
    let vmem = params.vmem_limit.map_or(String::new(), |bytes| {
        format!(
            ", \\\"scoped_memory_configs\\\": [{{\\\"memory_space\\\": 1, \\\"offset\\\": 0, \\\"size\\\": {bytes}}}]"
        )
    });
    Ok(format!(
        "{{\\\"custom_call_config\\\": {{\\\"body\\\": \\\"{body}\\\", \\\"needs_layout_passes\\\": true{cost}}}{vmem}}}"
    ))
}

/// The kernel called from `b` on `operands` (the tables, then the inputs, as
/// [`Kernel::operand_types`] lists them): a `tpu_custom_call` that libtpu compiles.
fn call(k: &Kernel, params: &MosaicParams, b: &mut FnBuilder, operands: &[Value]) -> Result<Vec<Value>> {
    let (operand_layouts, result_layouts) = custom_call_layouts(k, "mosaic", operands)?;
    let results = k.result_types();
    let attrs = format!(
        "call_target_name = \"tpu_custom_call\", backend_config = \"{}\", kernel_name = \"{}\", operand_layouts = [{operand_layouts}], result_layouts = [{result_layouts}]",
        backend_config(k, params)?,
        k.name,
    );
    b.custom_call(&format!("mosaic {}", k.name), operands, &results, &attrs)
}

#[cfg(test)]
mod tests {
    use super::base64;

    #[rstest::rstest]
    #[case::empty(b"", "")]
    #[case::one(b"f", "Zg==")]
    #[case::two(b"fo", "Zm8=")]
    #[case::three(b"foo", "Zm9v")]
    #[case::six(b"foobar", "Zm9vYmFy")]
    fn base64_matches_rfc_4648(#[case] bytes: &[u8], #[case] want: &str) {
        assert_eq!(base64(bytes), want);
    }
}
