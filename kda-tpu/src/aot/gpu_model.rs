//! A static model of a GPU program, named as such: not a time. Per launch its compulsory HBM
//! bytes (each operand read and each result written once, read from the optimized program),
//! and for the kernels of the kernel language their tensor-core and FMA FLOPs and
//! exponentials (counted from the kernel's definition), each with its floor at a GPU's peaks:
//! the time the launch could not beat if that resource alone bound it.

use crate::lang::work::work;
use crate::lang::Kernel;

/// A GPU's peak rates.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Peaks {
    /// HBM bytes a second.
    pub hbm_bytes_per_s: f64,
    /// Dense bf16 tensor-core FLOPs a second (TF32 passes counted at this rate too).
    pub tensor_flops: f64,
    /// f32 FMA-unit FLOPs a second (an FMA is two).
    pub fma_flops: f64,
    /// Exponentials (MUFU `ex2`) a second.
    pub exp_per_s: f64,
}

/// The H200's peaks: 4.8 TB/s, 989 TFLOP/s dense bf16, 66.9 TFLOP/s f32 FMA (132 SMs x 128
/// lanes x 1.98 GHz x 2), 4.2 T exponentials/s (16 MUFU per SM and clock).
pub const H200_PEAKS: Peaks =
    Peaks { hbm_bytes_per_s: 4.8e12, tensor_flops: 989e12, fma_flops: 66.9e12, exp_per_s: 4.2e12 };

/// One launch of the model.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LaunchModel {
    /// The launch (a kernel's name, or the XLA op's).
    pub name: String,
    /// Compulsory HBM bytes: operands read once, results written once.
    pub bytes: f64,
    /// Tensor-core FLOPs (a three-pass product counts three passes).
    pub tensor_flops: f64,
    /// FMA-unit FLOPs: elementwise arithmetic, reductions, running sums, IEEE products.
    pub fma_flops: f64,
    /// Exponentials.
    pub exps: f64,
}

/// The floors of a launch or a program, in seconds.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Floors {
    /// Bytes at the HBM rate.
    pub memory: f64,
    /// Tensor-core FLOPs at their rate.
    pub tensor: f64,
    /// FMA FLOPs at their rate.
    pub fma: f64,
    /// Exponentials at their rate.
    pub exp: f64,
}

impl Floors {
    /// The largest: the launch's floor.
    pub fn max(&self) -> f64 {
        self.memory.max(self.tensor).max(self.fma).max(self.exp)
    }
}

impl LaunchModel {
    /// A launch that only moves `bytes` (an XLA op, a memset, a kernel known by its traffic).
    pub fn traffic(name: &str, bytes: f64) -> Self {
        LaunchModel { name: name.to_string(), bytes, ..Default::default() }
    }

    /// Each resource's floor at `p`.
    pub fn floors(&self, p: &Peaks) -> Floors {
        Floors {
            memory: self.bytes / p.hbm_bytes_per_s,
            tensor: self.tensor_flops / p.tensor_flops,
            fma: self.fma_flops / p.fma_flops,
            exp: self.exps / p.exp_per_s,
        }
    }
}

/// A program's launches in order.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ProgramModel {
    /// The launches.
    pub launches: Vec<LaunchModel>,
}

impl ProgramModel {
    /// Launches per call.
    pub fn launches(&self) -> usize {
        self.launches.len()
    }

    /// Total compulsory HBM bytes.
    pub fn bytes(&self) -> f64 {
        self.launches.iter().map(|l| l.bytes).sum()
    }

    /// Bytes per token and head, for a program over `token_heads` of them.
    pub fn bytes_per_token_head(&self, token_heads: f64) -> f64 {
        self.bytes() / token_heads
    }

    /// The sum of the launches' floors at `p` (launches run one after another), seconds.
    pub fn floor(&self, p: &Peaks) -> f64 {
        self.launches.iter().map(|l| l.floors(p).max()).sum()
    }

    /// Each resource's floor summed over the launches, seconds.
    pub fn floors(&self, p: &Peaks) -> Floors {
        let mut f = Floors::default();
        for l in &self.launches {
            let x = l.floors(p);
            f.memory += x.memory;
            f.tensor += x.tensor;
            f.fma += x.fma;
            f.exp += x.exp;
        }
        f
    }
}

/// The model of kernel `k` from its definition ([`crate::lang::work`]): its operands and
/// results once each (whole arrays), its body's work on every grid step.
pub fn kernel_work(k: &Kernel) -> LaunchModel {
    let w = work(k);
    LaunchModel {
        name: k.name().to_string(),
        bytes: w.bytes,
        tensor_flops: w.tensor_flops,
        fma_flops: w.fma_flops,
        exps: w.exps,
    }
}

/// The launches of an optimized HLO module's entry computation (`ENTRY`): each fusion, custom
/// call, copy or other op that XLA runs as a kernel, with its operands' and results' bytes (a
/// Triton call named by its function). Parameters, constants, tuples, bitcasts and control
/// flow move nothing themselves.
pub fn hlo_launches(text: &str) -> Vec<LaunchModel> {
    // Each value's bytes, per tuple element.
    let mut values: std::collections::HashMap<String, Vec<f64>> = std::collections::HashMap::new();
    let mut out = Vec::new();
    let Some(entry) = text.find("\nENTRY ") else { return out };
    for line in text[entry + 1..].lines().skip(1) {
        let line = line.trim();
        if line.starts_with('}') {
            break;
        }
        let Some((lhs, rhs)) = line.split_once(" = ") else { continue };
        let name = lhs.trim_start_matches("ROOT ").trim().trim_start_matches('%').to_string();
        let (result, rest) = split_shape(rhs);
        let elements = shape_bytes(result);
        let written: f64 = elements.iter().sum();
        let op = rest.trim_start().split('(').next().unwrap_or("").trim().to_string();
        values.insert(name.clone(), elements);
        let moves = !matches!(
            op.as_str(),
            "parameter"
                | "constant"
                | "tuple"
                | "get-tuple-element"
                | "bitcast"
                | "while"
                | "conditional"
                | "call"
        ) && !op.is_empty();
        if !moves {
            continue;
        }
        let args = rest.split_once('(').map(|(_, a)| a).unwrap_or("");
        let args = args.split(')').next().unwrap_or("");
        let read: f64 = args.split(',').filter_map(|a| operand_bytes(&values, a)).sum();
        out.push(LaunchModel::traffic(&launch_name(&name, rest), read + written));
    }
    out
}

/// The bytes of operand text `a` (`%x`, `%x#1` for a tuple element, after any `/*..*/`).
fn operand_bytes(values: &std::collections::HashMap<String, Vec<f64>>, a: &str) -> Option<f64> {
    let a = a.rsplit("*/").next()?.trim().trim_start_matches('%');
    let (name, element) = match a.split_once('#') {
        Some((n, i)) => (n, i.parse::<usize>().ok()),
        None => (a, None),
    };
    let v = values.get(name)?;
    Some(match element {
        Some(i) => *v.get(i)?,
        None => v.iter().sum(),
    })
}

/// A Triton call's function name, else the op's own.
fn launch_name(name: &str, rest: &str) -> String {
    rest.split("tt.func public @")
        .nth(1)
        .and_then(|s| s.split('(').next())
        .map(str::to_string)
        .unwrap_or_else(|| name.to_string())
}

/// The result shape text at the start of `rhs` (`f32[8,16]{1,0}` or a tuple `(..)`) and the rest.
fn split_shape(rhs: &str) -> (&str, &str) {
    let rhs = rhs.trim_start();
    if rhs.starts_with('(') {
        let mut depth = 0;
        for (i, c) in rhs.char_indices() {
            match c {
                '(' => depth += 1,
                ')' => {
                    depth -= 1;
                    if depth == 0 {
                        return (&rhs[..=i], &rhs[i + 1..]);
                    }
                }
                _ => {}
            }
        }
        return (rhs, "");
    }
    match rhs.find(' ') {
        Some(i) => (&rhs[..i], &rhs[i..]),
        None => (rhs, ""),
    }
}

/// Bytes of each array in a shape text (`bf16[8,1024,128]{2,1,0}`; a tuple's elements in order).
fn shape_bytes(shape: &str) -> Vec<f64> {
    let mut out = Vec::new();
    for part in shape.split(['(', ')', ' ']) {
        let Some((ty, dims)) = part.split_once('[') else { continue };
        let ty = ty.trim_start_matches(',');
        let size = match ty {
            "f64" | "s64" | "u64" => 8.0,
            "f32" | "s32" | "u32" => 4.0,
            "bf16" | "f16" | "s16" | "u16" => 2.0,
            "pred" | "s8" | "u8" => 1.0,
            _ => continue,
        };
        let dims = dims.split(']').next().unwrap_or("");
        let n: f64 =
            dims.split(',').filter(|d| !d.is_empty()).filter_map(|d| d.trim().parse::<f64>().ok()).product();
        out.push(size * if dims.is_empty() { 1.0 } else { n });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entry_ops_read_their_operands_and_write_their_results() {
        let text = "HloModule m\n\nfused_computation {\n  p = f32[4]{0} parameter(0)\n}\n\nENTRY %main (a: bf16[8,16]) -> f32[8,16] {\n  %a = bf16[8,16]{1,0} parameter(0)\n  %convert_fusion = f32[8,16]{1,0} fusion(%a), kind=kLoop, calls=%fused_computation\n  %t = (f32[8,16]{1,0}, s32[2]{0}) custom-call(%convert_fusion, /*index=1*/%a), custom_call_target=\"__gpu$xla.gpu.triton\", backend_config={ir = \"module {\\0A  tt.func public @kda_gpu_wy(%in0: !tt.ptr<f32>)\"}\n  ROOT %u = f32[8,16]{1,0} fusion(%t#0), kind=kLoop\n}\n";
        let l = hlo_launches(text);
        let got: Vec<(&str, f64)> = l.iter().map(|x| (x.name.as_str(), x.bytes)).collect();
        assert_eq!(
            got,
            [
                ("convert_fusion", 256.0 + 512.0),
                ("kda_gpu_wy", 512.0 + 256.0 + 512.0 + 8.0),
                ("u", 512.0 + 512.0)
            ]
        );
    }

    /// fla-core 0.6.0's `chunk_kda` forward as a list of launches, each with the tensors it
    /// reads and writes per token and head (elements, bytes each; K = V = 128, chunks of 64,
    /// sub-chunks of 16; `fla/ops/kda/chunk_fwd.py`, `chunk_intra.py`, `wy_fast.py`,
    /// `common/chunk_delta_h.py`, `gla/chunk.py`, `utils/cumsum.py`, `modules/norm/l2norm.py`):
    /// each tensor once, memsets as writes, per-chunk rows as `K / 64`.
    fn fla_forward(l2norm: bool) -> Vec<(&'static str, Vec<(f64, f64)>)> {
        let (k, v, bt, bc) = (128.0, 128.0, 64.0, 16.0);
        let mut launches = Vec::new();
        if l2norm {
            for name in ["l2norm_fwd q", "l2norm_fwd k"] {
                launches.push((name, vec![(k, 2.0), (k, 2.0), (1.0, 4.0)]));
            }
        }
        launches.extend([
            ("gate cumsum", vec![(k, 2.0), (k, 4.0)]),
            ("memset Akk", vec![(bt, 2.0)]),
            ("intra diagonal", vec![(k, 2.0), (k, 2.0), (k, 4.0), (1.0, 2.0), (bc, 2.0), (bc, 4.0)]),
            (
                "inter solve",
                vec![
                    (0.75 * k, 2.0),
                    (k, 2.0),
                    (k, 4.0),
                    (3.0 * k / bt, 4.0),
                    (0.75, 2.0),
                    (bc, 4.0),
                    (24.0, 2.0),
                    (40.0, 2.0),
                ],
            ),
            (
                "recompute w u",
                vec![
                    (k, 2.0),
                    (v, 2.0),
                    (1.0, 2.0),
                    (bt, 2.0),
                    (k, 4.0),
                    (k / bt, 4.0),
                    (k, 2.0),
                    (v, 2.0),
                    (k, 2.0),
                ],
            ),
            ("fwd h", vec![(k, 2.0), (k, 2.0), (v, 2.0), (k / bt, 4.0), (k * v / bt, 2.0), (v, 2.0)]),
            ("memset o", vec![(v, 2.0)]),
            ("fwd o", vec![(k, 2.0), (k, 4.0), (k * v / bt, 2.0), (v, 2.0), (bt, 2.0), (v, 2.0)]),
        ]);
        launches
    }

    /// The model fed fla's kernel list gives its compulsory traffic per token and head (8,845 B
    /// at H=8, T=1024; 9,877 B at H=32, T=8192 with the L2 norm and the in-kernel gate) and its
    /// launches (8 and 10).
    #[rstest::rstest]
    #[case::s1(8, 1024, false, 8845.5, 8)]
    #[case::s2(32, 8192, true, 9877.5, 10)]
    fn fla_forward_moves_what_its_kernel_list_says(
        #[case] heads: usize,
        #[case] t: usize,
        #[case] l2norm: bool,
        #[case] bytes: f64,
        #[case] launches: usize,
    ) {
        let th = (heads * t) as f64;
        let model = ProgramModel {
            launches: fla_forward(l2norm)
                .into_iter()
                .map(|(name, tensors)| {
                    LaunchModel::traffic(name, th * tensors.iter().map(|(n, b)| n * b).sum::<f64>())
                })
                .collect(),
        };
        assert_eq!(model.launches(), launches);
        assert!((model.bytes_per_token_head(th) - bytes).abs() < 1e-6, "{}", model.bytes_per_token_head(th));
        // Its memory floor at S2: 9,877.5 B x 262,144 token-heads at 4.8 TB/s, 0.54 ms.
        let floor = model.floors(&H200_PEAKS).memory;
        assert!((floor - th * bytes / 4.8e12).abs() < 1e-12);
    }

    /// A kernel's work: its operands once, each op on every grid step, a loop's body on every
    /// trip, a three-pass product three times.
    #[test]
    fn a_kernels_work_counts_each_op_on_every_step() -> crate::Result<()> {
        use crate::hlo::TensorType;
        use crate::lang::{Index, KernelBuilder, MatPrecision, Operand, Semantics};
        use kda_core::DType;
        let ty = |d: &[i64]| TensorType::new(DType::F32, d);
        let at = || vec![Index::Grid(0), Index::Const(0), Index::Const(0)];
        let mut kb = KernelBuilder::new("k");
        kb.grid(4, Semantics::Parallel);
        let x = kb.input(Operand::blocked("x", ty(&[4, 16, 32]), &[1, 16, 32], at()));
        let y = kb.output(Operand::blocked("y", ty(&[4, 16, 16]), &[1, 16, 16], at()));
        let k = kb.build(|b| {
            let a = b.load_all(x)?;
            let a = b.reshape(&a, &[16, 32])?;
            let e = b.exp(&a)?;
            let p = b.matmul(&e, &a, (1, 1), MatPrecision::Tf32x3)?;
            let outs = b.for_range(0, 3, &[p], |b, _, c| Ok(vec![b.add(&c[0], &c[0])?]))?;
            let r = b.reshape(&outs[0], &[1, 16, 16])?;
            b.store_all(y, &r)
        })?;
        let w = kernel_work(&k);
        assert_eq!(w.bytes, (4.0 * 16.0 * 32.0 + 4.0 * 16.0 * 16.0) * 4.0);
        assert_eq!(w.exps, 4.0 * 16.0 * 32.0);
        assert_eq!(w.tensor_flops, 4.0 * 3.0 * 2.0 * 16.0 * 16.0 * 32.0);
        assert_eq!(w.fma_flops, 4.0 * 3.0 * 16.0 * 16.0);
        Ok(())
    }
}
