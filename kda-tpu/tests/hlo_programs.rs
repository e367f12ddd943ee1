//! Builds small programs with the typed builder and runs them on the CPU PJRT plugin,
//! checking the numbers against naive Rust. Needs `cargo xtask setup` (the CPU plugin). Without
//! the `runtime` feature every program is still built (and type-checked by the builder), but
//! nothing executes.

#[macro_use]
mod hlo_support;

use hlo_support::{assert_close, rand_vec, In};
use kda_core::DType;
use kda_tpu::hlo::{Cmp, FnBuilder, Module, Precision, TensorType, Transpose, TriangularSolve};
use kda_tpu::Result;
#[cfg(feature = "harness")]
use rstest::rstest;

fn f32t(dims: &[i64]) -> TensorType {
    TensorType::new(DType::F32, dims)
}

fn module(f: FnBuilder) -> Result<String> {
    let mut m = Module::new();
    m.add(f)?;
    Ok(m.to_text())
}

#[test]
fn elementwise_ops_match_rust() -> Result<()> {
    let mut b = FnBuilder::new("main", true);
    let x = b.arg(f32t(&[4, 8]))?;
    let y = b.arg(f32t(&[4, 8]))?;
    let v = b.arg(f32t(&[8]))?;
    let mut outs = vec![b.add(x, y)?, b.sub(x, y)?, b.mul(x, y)?, b.div(x, y)?, b.max(x, y)?, b.min(x, y)?];
    for op in [FnBuilder::neg, FnBuilder::exp, FnBuilder::log, FnBuilder::log1p, FnBuilder::sqrt] {
        outs.push(op(&mut b, x)?);
    }
    for op in [FnBuilder::rsqrt, FnBuilder::abs, FnBuilder::logistic, FnBuilder::tanh, FnBuilder::expm1] {
        outs.push(op(&mut b, x)?);
    }
    outs.push(b.mul_bcast(x, v)?);
    outs.push(b.add_const(x, -1.0e-3)?);
    outs.push(b.pow(x, y)?);
    b.ret(&outs)?;
    let text = module(b)?;
    let xs = rand_vec(32, 1, 0.25, 2.0);
    let ys = rand_vec(32, 2, 0.25, 2.0);
    let vs = rand_vec(8, 3, -1.0, 1.0);
    let got = run!(
        &text,
        vec![In::F32(xs.clone(), vec![4, 8]), In::F32(ys.clone(), vec![4, 8]), In::F32(vs.clone(), vec![8])],
    );
    type F = fn(f32, f32, f32) -> f32;
    let refs: [(&str, F); 19] = [
        ("add", |a, b, _| a + b),
        ("sub", |a, b, _| a - b),
        ("mul", |a, b, _| a * b),
        ("div", |a, b, _| a / b),
        ("max", |a, b, _| a.max(b)),
        ("min", |a, b, _| a.min(b)),
        ("neg", |a, _, _| -a),
        ("exp", |a, _, _| a.exp()),
        ("log", |a, _, _| a.ln()),
        ("log1p", |a, _, _| a.ln_1p()),
        ("sqrt", |a, _, _| a.sqrt()),
        ("rsqrt", |a, _, _| 1.0 / a.sqrt()),
        ("abs", |a, _, _| a.abs()),
        ("logistic", |a, _, _| 1.0 / (1.0 + (-a).exp())),
        ("tanh", |a, _, _| a.tanh()),
        ("expm1", |a, _, _| a.exp_m1()),
        ("mul_bcast", |a, _, v| a * v),
        ("add_const", |a, _, _| a - 1.0e-3),
        ("pow", |a, b, _| a.powf(b)),
    ];
    assert_eq!(got.len(), refs.len());
    for (out, (name, f)) in got.iter().zip(refs) {
        let want: Vec<f32> = (0..32).map(|i| f(xs[i], ys[i], vs[i % 8])).collect();
        assert_close(name, &out.f32s(), &want, 2e-6);
    }
    Ok(())
}

/// Naive `[B, M, K] x [B, K, N]` in f64.
fn bmm(a: &[f32], b: &[f32], bs: usize, m: usize, k: usize, n: usize) -> Vec<f32> {
    let mut out = vec![0.0; bs * m * n];
    for p in 0..bs {
        for i in 0..m {
            for j in 0..n {
                let s: f64 =
                    (0..k).map(|l| a[(p * m + i) * k + l] as f64 * b[(p * k + l) * n + j] as f64).sum();
                out[(p * m + i) * n + j] = s as f32;
            }
        }
    }
    out
}

fn transpose_last2(x: &[f32], bs: usize, r: usize, c: usize) -> Vec<f32> {
    let mut out = vec![0.0; x.len()];
    for p in 0..bs {
        for i in 0..r {
            for j in 0..c {
                out[(p * c + j) * r + i] = x[(p * r + i) * c + j];
            }
        }
    }
    out
}

#[test]
fn batched_dot_f32_and_bf16() -> Result<()> {
    let (bs, m, k, n) = (3usize, 5usize, 7usize, 4usize);
    let mut b = FnBuilder::new("main", true);
    let a = b.arg(f32t(&[3, 5, 7]))?;
    let w = b.arg(f32t(&[3, 7, 4]))?;
    let ab = b.arg(TensorType::new(DType::BF16, &[3, 5, 7]))?;
    let wb = b.arg(TensorType::new(DType::BF16, &[3, 7, 4]))?;
    b.set_dot_precision(Precision::Highest);
    let d = b.dot_general(a, w, &[0], &[0], &[2], &[1], DType::F32)?;
    b.set_dot_precision(Precision::Default);
    let db = b.dot_general(ab, wb, &[0], &[0], &[2], &[1], DType::F32)?;
    // a^T-form: at [3,7,5] and wt [3,4,7] with both transposes gives the same product.
    let at = b.transpose(a, &[0, 2, 1])?;
    let wt = b.transpose(w, &[0, 2, 1])?;
    let dt = b.batch_matmul(at, wt, Transpose::Both)?;
    let dn = b.batch_matmul(a, w, Transpose::None)?;
    b.ret(&[d, db, dt, dn])?;
    let text = module(b)?;
    let av = rand_vec(bs * m * k, 4, -1.0, 1.0);
    let wv = rand_vec(bs * k * n, 5, -1.0, 1.0);
    let to_bf = |x: &[f32]| x.iter().map(|&v| half::bf16::from_f32(v)).collect::<Vec<_>>();
    let (abf, wbf) = (to_bf(&av), to_bf(&wv));
    let got = run!(
        &text,
        vec![
            In::F32(av.clone(), vec![3, 5, 7]),
            In::F32(wv.clone(), vec![3, 7, 4]),
            In::Bf16(abf.clone(), vec![3, 5, 7]),
            In::Bf16(wbf.clone(), vec![3, 7, 4]),
        ],
    );
    let want = bmm(&av, &wv, bs, m, k, n);
    assert_close("dot f32", &got[0].f32s(), &want, 1e-6);
    let back = |x: &[half::bf16]| x.iter().map(|v| v.to_f32()).collect::<Vec<_>>();
    let want_bf = bmm(&back(&abf), &back(&wbf), bs, m, k, n);
    assert_eq!(got[1].dims, vec![3, 5, 4]);
    assert_close("dot bf16xbf16->f32", &got[1].f32s(), &want_bf, 1e-6);
    assert_close("batch_matmul transposed", &got[2].f32s(), &want, 1e-6);
    assert_close("batch_matmul", &got[3].f32s(), &want, 1e-6);
    let _ = transpose_last2;
    Ok(())
}

#[test]
fn reductions_and_cumsum() -> Result<()> {
    let (p, t, q) = (3usize, 64usize, 5usize);
    let mut b = FnBuilder::new("main", true);
    let x = b.arg(f32t(&[3, 64, 5]))?;
    let s1 = b.reduce_sum(x, &[1])?;
    let s02 = b.reduce_sum(x, &[2, 0])?;
    let m1 = b.reduce_max(x, &[1])?;
    let mn = b.reduce_min(x, &[0, 1, 2])?;
    let c = b.cumsum(x, 1, false)?;
    let cr = b.cumsum(x, 1, true)?;
    b.ret(&[s1, s02, m1, mn, c, cr])?;
    let xs = rand_vec(p * t * q, 6, -1.0, 1.0);
    let got = run!(&module(b)?, vec![In::F32(xs.clone(), vec![3, 64, 5])]);
    let at = |i: usize, j: usize, l: usize| xs[(i * t + j) * q + l];
    let mut s1w = vec![0.0f32; p * q];
    let mut m1w = vec![f32::NEG_INFINITY; p * q];
    let mut s02w = vec![0.0f32; t];
    let mut cw = vec![0.0f32; p * t * q];
    let mut crw = vec![0.0f32; p * t * q];
    for i in 0..p {
        for l in 0..q {
            let (mut acc, mut racc) = (0.0f64, 0.0f64);
            for j in 0..t {
                s1w[i * q + l] += at(i, j, l);
                m1w[i * q + l] = m1w[i * q + l].max(at(i, j, l));
                s02w[j] += at(i, j, l);
                acc += at(i, j, l) as f64;
                cw[(i * t + j) * q + l] = acc as f32;
                racc += at(i, t - 1 - j, l) as f64;
                crw[(i * t + t - 1 - j) * q + l] = racc as f32;
            }
        }
    }
    assert_close("reduce_sum [1]", &got[0].f32s(), &s1w, 1e-5);
    assert_close("reduce_sum [0,2]", &got[1].f32s(), &s02w, 1e-5);
    assert_eq!(got[2].f32s(), m1w, "reduce_max");
    assert_eq!(got[3].f32s(), vec![xs.iter().copied().fold(f32::INFINITY, f32::min)], "reduce_min");
    assert_close("cumsum", &got[4].f32s(), &cw, 1e-5);
    assert_close("cumsum reverse", &got[5].f32s(), &crw, 1e-5);
    Ok(())
}

#[test]
fn gathers_and_scatter() -> Result<()> {
    let mut b = FnBuilder::new("main", true);
    let table = b.arg(f32t(&[10, 3, 4]))?;
    let idx = b.arg(TensorType::new(DType::I32, &[6]))?;
    let bidx = b.arg(TensorType::new(DType::I32, &[10, 2]))?;
    let rows = b.gather_rows(table, idx)?;
    let ax2 = b.gather_axis(table, 2, idx)?;
    let idx3 = b.slice_axis(bidx, 1, 0, 2)?;
    let batched = b.gather_axis(table, 1, idx3)?;
    let upd = b.arg(f32t(&[6, 3, 4]))?;
    let sc = b.scatter_rows_add(table, idx, upd)?;
    b.ret(&[rows, ax2, batched, sc])?;
    let tv = rand_vec(120, 7, -1.0, 1.0);
    let iv = vec![9, 0, 3, 3, 1, 2];
    let bv: Vec<i32> = (0..20).map(|i| i * 7 % 3).collect();
    let uv = rand_vec(72, 8, -1.0, 1.0);
    let got = run!(
        &module(b)?,
        vec![
            In::F32(tv.clone(), vec![10, 3, 4]),
            In::I32(iv.clone(), vec![6]),
            In::I32(bv.clone(), vec![10, 2]),
            In::F32(uv.clone(), vec![6, 3, 4]),
        ],
    );
    let t = |i: usize, j: usize, k: usize| tv[(i * 3 + j) * 4 + k];
    let rows_w: Vec<f32> =
        iv.iter().flat_map(|&r| tv[r as usize * 12..r as usize * 12 + 12].to_vec()).collect();
    assert_eq!(got[0].f32s(), rows_w, "gather_rows");
    let mut ax2w = vec![];
    for i in 0..10 {
        for j in 0..3 {
            for &m in &iv {
                ax2w.push(if m < 4 { t(i, j, m as usize) } else { t(i, j, 3) });
            }
        }
    }
    assert_eq!(got[1].dims, vec![10, 3, 6]);
    assert_eq!(got[1].f32s(), ax2w, "gather_axis 2 (index 9 clamps to 3)");
    let mut bw = vec![];
    for i in 0..10 {
        for m in 0..2 {
            for k in 0..4 {
                bw.push(t(i, bv[i * 2 + m] as usize, k));
            }
        }
    }
    assert_eq!(got[2].dims, vec![10, 2, 4]);
    assert_eq!(got[2].f32s(), bw, "batched gather_axis 1");
    let mut sw = tv.clone();
    for (m, &r) in iv.iter().enumerate() {
        for e in 0..12 {
            sw[r as usize * 12 + e] += uv[m * 12 + e];
        }
    }
    assert_close("scatter_rows_add", &got[3].f32s(), &sw, 1e-6);
    Ok(())
}

#[test]
fn while_loop_with_dynamic_slices() -> Result<()> {
    // Row-wise running product out[i] = x[0] * .. * x[i], and the recurrence
    // S_i = 0.5 * S_{i-1} + k_i^T k_i (k_i = row i as [1, 4]), both through dynamic slices.
    let mut b = FnBuilder::new("main", true);
    let x = b.arg(f32t(&[8, 4]))?;
    let one = b.constant_f32(1.0, f32t(&[1, 4]))?;
    let out0 = b.constant_f32(0.0, f32t(&[8, 4]))?;
    let s0 = b.constant_f32(0.0, f32t(&[4, 4]))?;
    let fin = b.for_loop(8, &[one, out0, s0], |b, i, st| {
        let zero = b.scalar_i32(0)?;
        let row = b.dynamic_slice(x, &[i, zero], &[1, 4])?;
        let acc = b.mul(st[0], row)?;
        let out = b.dynamic_update_slice(st[1], acc, &[i, zero])?;
        let kk = b.dot_general(row, row, &[], &[], &[0], &[0], DType::F32)?;
        let decayed = b.mul_const(st[2], 0.5)?;
        let s = b.add(decayed, kk)?;
        Ok(vec![acc, out, s])
    })?;
    b.ret(&[fin[1], fin[2]])?;
    let xs = rand_vec(32, 9, 0.5, 1.5);
    let got = run!(&module(b)?, vec![In::F32(xs.clone(), vec![8, 4])]);
    let mut acc = [1.0f32; 4];
    let mut out = vec![0.0f32; 32];
    let mut s = [0.0f32; 16];
    for i in 0..8 {
        for j in 0..4 {
            acc[j] *= xs[i * 4 + j];
            out[i * 4 + j] = acc[j];
        }
        for p in 0..4 {
            for q in 0..4 {
                s[p * 4 + q] = 0.5 * s[p * 4 + q] + xs[i * 4 + p] * xs[i * 4 + q];
            }
        }
    }
    assert_close("prefix product", &got[0].f32s(), &out, 1e-6);
    assert_close("recurrence", &got[1].f32s(), &s, 1e-6);
    Ok(())
}

#[rstest::rstest]
#[case::no_trips(0)]
#[case::some_trips(3)]
#[case::every_row(6)]
fn loop_with_run_time_trip_count(#[case] trips: i32) -> Result<()> {
    // Running sum of the first `trips` rows of x, written row by row into a buffer of ones:
    // rows at or after `trips` keep their initial value.
    let mut b = FnBuilder::new("main", true);
    let x = b.arg(f32t(&[6, 3]))?;
    let n = b.arg(TensorType::new(DType::I32, &[]))?;
    let acc0 = b.constant_f32(0.0, f32t(&[1, 3]))?;
    let out0 = b.constant_f32(1.0, f32t(&[6, 3]))?;
    let fin = b.for_loop_until(n, &[acc0, out0], |b, i, st| {
        let zero = b.scalar_i32(0)?;
        let row = b.dynamic_slice(x, &[i, zero], &[1, 3])?;
        let acc = b.add(st[0], row)?;
        let out = b.dynamic_update_slice(st[1], acc, &[i, zero])?;
        Ok(vec![acc, out])
    })?;
    b.ret(&[fin[1]])?;
    let xs = rand_vec(18, 11, -1.0, 1.0);
    let got = run!(&module(b)?, vec![In::F32(xs.clone(), vec![6, 3]), In::I32(vec![trips], vec![])]);
    let mut want = vec![1.0f32; 18];
    let mut acc = [0.0f32; 3];
    for i in 0..trips as usize {
        for j in 0..3 {
            acc[j] += xs[i * 3 + j];
            want[i * 3 + j] = acc[j];
        }
    }
    assert_close("bounded running sum", &got[0].f32s(), &want, 1e-6);
    Ok(())
}

// The building blocks come from `op::xla::parts` (the `harness` feature).
#[cfg(feature = "harness")]
#[test]
fn wy_inverse_inverts_unit_lower_chunks() -> Result<()> {
    // The chunk solve `(I + L)^-1` (16-row blocks by repeated squaring, then two doublings)
    // against the definition: (I + L) A = I for random strictly lower L.
    let (n, c, k) = (3usize, 64usize, 8usize);
    let text = kda_tpu::op::parts::program("inverse", n as i64, k as i64)?;
    let tok = |seed| In::F32(rand_vec(n * c * k, seed, -1.0, 1.0), vec![n as i64, c as i64, k as i64]);
    let raw = rand_vec(n * c * c, 21, -0.3, 0.3);
    let l: Vec<f32> =
        raw.iter().enumerate().map(|(i, &x)| if (i / c) % c > i % c { x } else { 0.0 }).collect();
    let inputs = vec![
        tok(1),
        tok(2),
        tok(3),
        tok(4),
        In::F32(vec![0.5; n * c], vec![n as i64, c as i64, 1]),
        In::F32(l.clone(), vec![n as i64, c as i64, c as i64]),
    ];
    let a = run!(&text, inputs)[0].f32s();
    let mut prod = vec![0.0f32; n * c * c];
    for m in 0..n {
        for i in 0..c {
            for j in 0..c {
                let mut acc = a[(m * c + i) * c + j] as f64;
                for p in 0..i {
                    acc += l[(m * c + i) * c + p] as f64 * a[(m * c + p) * c + j] as f64;
                }
                prod[(m * c + i) * c + j] = acc as f32;
            }
        }
    }
    let eye: Vec<f32> = (0..n * c * c).map(|i| if (i / c) % c == i % c { 1.0 } else { 0.0 }).collect();
    assert_close("(I + L) A", &prod, &eye, 1e-4);
    Ok(())
}

// The building blocks come from `op::xla::parts` (the `harness` feature).
#[cfg(feature = "harness")]
#[rstest]
#[case::moderate_gates(-1.0)]
#[case::strong_decay_to_the_floor(-30.0)]
fn decay_factor_forms_agree(#[case] lowest: f32) -> Result<()> {
    // The CPU configuration forms the in-sub-block decay factors as products of exp(g), the
    // TPU configuration as exponentials of sums: the same factors to a few ulps (all are <= 1),
    // and the same decayed grams. Gates include exact zeros (padding rows) and the floor.
    let (n, c, k) = (3usize, 64usize, 16usize);
    let mut g = rand_vec(n * c * k, 5, lowest, 0.0);
    for (i, x) in g.iter_mut().enumerate() {
        match i % 37 {
            0 => *x = 0.0,
            1 => *x = kda_tpu::op::GATE_FLOOR,
            _ => {}
        }
    }
    let dims = vec![n as i64, c as i64, k as i64];
    let inputs = || {
        vec![
            In::F32(rand_vec(n * c * k, 6, -1.0, 1.0), dims.clone()),
            In::F32(rand_vec(n * c * k, 7, -1.0, 1.0), dims.clone()),
            In::F32(g.clone(), dims.clone()),
        ]
    };
    let products = run!(&kda_tpu::op::parts::decay_forms(n as i64, k as i64, true)?, inputs());
    let sums = run!(&kda_tpu::op::parts::decay_forms(n as i64, k as i64, false)?, inputs());
    assert_eq!(products.len(), sums.len());
    for (i, (p, e)) in products.iter().zip(&sums).enumerate() {
        assert_close(&format!("output {i}"), &p.f32s(), &e.f32s(), 2e-6);
    }
    Ok(())
}

/// Naive op(A) for the last two dims of a [bs, m, m] tensor, honouring lower/unit flags.
fn tri(a: &[f32], bs: usize, m: usize, lower: bool, unit: bool, transpose: bool) -> Vec<f32> {
    let mut t = vec![0.0; a.len()];
    for p in 0..bs {
        for i in 0..m {
            for j in 0..m {
                let keep = if lower { j <= i } else { j >= i };
                let v = if i == j && unit {
                    1.0
                } else if keep {
                    a[(p * m + i) * m + j]
                } else {
                    0.0
                };
                let (r, c) = if transpose { (j, i) } else { (i, j) };
                t[(p * m + r) * m + c] = v;
            }
        }
    }
    t
}

#[test]
fn triangular_solve_matches_substitution() -> Result<()> {
    let (bs, m, n) = (2usize, 16usize, 8usize);
    let mut b = FnBuilder::new("main", true);
    let a = b.arg(f32t(&[2, 16, 16]))?;
    let rhs = b.arg(f32t(&[2, 16, 8]))?;
    let rhs_r = b.arg(f32t(&[2, 8, 16]))?;
    let x = b.triangular_solve(
        a,
        rhs,
        TriangularSolve { left_side: true, lower: true, unit_diagonal: true, transpose_a: false },
    )?;
    let y = b.triangular_solve(
        a,
        rhs_r,
        TriangularSolve { left_side: false, lower: true, unit_diagonal: false, transpose_a: true },
    )?;
    b.ret(&[x, y])?;
    // Off-diagonal entries small, diagonal garbage (ignored when unit) or >= 1.
    let mut av = rand_vec(bs * m * m, 10, -0.3, 0.3);
    for p in 0..bs {
        for i in 0..m {
            av[(p * m + i) * m + i] = 1.0 + av[(p * m + i) * m + i].abs() * 3.0;
        }
    }
    let bv = rand_vec(bs * m * n, 11, -1.0, 1.0);
    let br = rand_vec(bs * n * m, 12, -1.0, 1.0);
    let got = run!(
        &module(b)?,
        vec![
            In::F32(av.clone(), vec![2, 16, 16]),
            In::F32(bv.clone(), vec![2, 16, 8]),
            In::F32(br.clone(), vec![2, 8, 16]),
        ],
    );
    // Forward substitution with unit diagonal: x_i = b_i - sum_{j<i} a_ij x_j.
    let mut xw = bv.clone();
    for p in 0..bs {
        for c in 0..n {
            for i in 0..m {
                let mut s = bv[(p * m + i) * n + c] as f64;
                for j in 0..i {
                    s -= av[(p * m + i) * m + j] as f64 * xw[(p * m + j) * n + c] as f64;
                }
                xw[(p * m + i) * n + c] = s as f32;
            }
        }
    }
    assert_close("unit lower left solve", &got[0].f32s(), &xw, 1e-5);
    // Right side, transposed, non-unit: check Y * L^T == B.
    let lt = tri(&av, bs, m, true, false, true);
    let yl = bmm(&got[1].f32s(), &lt, bs, n, m, m);
    assert_close("right transposed solve (residual)", &yl, &br, 1e-5);
    Ok(())
}

#[test]
fn shape_ops_match_rust() -> Result<()> {
    let mut b = FnBuilder::new("main", true);
    let v = b.arg(f32t(&[4]))?;
    let x = b.arg(f32t(&[2, 3, 4]))?;
    let bi = b.broadcast_in_dim(v, &[3, 4, 5], &[1])?;
    let bt = b.broadcast_to(v, &[2, 3, 4])?;
    let tr = b.transpose(x, &[2, 0, 1])?;
    let rs = b.reshape(x, &[6, 4])?;
    let sl = b.slice(rs, &[1, 0], &[6, 4], &[2, 3])?;
    let cc = b.concatenate(&[x, bt], 1)?;
    let z = b.constant_f32(-1.0, TensorType::scalar(DType::F32))?;
    let pd = b.pad(v, z, &[1], &[-1], &[1])?;
    let rv = b.reverse(x, &[0, 2])?;
    b.ret(&[bi, bt, tr, sl, cc, pd, rv])?;
    let vs = vec![1.0, 2.0, 3.0, 4.0];
    let xs: Vec<f32> = (0..24).map(|i| i as f32).collect();
    let got = run!(&module(b)?, vec![In::F32(vs.clone(), vec![4]), In::F32(xs.clone(), vec![2, 3, 4])]);
    let bi_w: Vec<f32> = (0..60).map(|e| vs[(e / 5) % 4]).collect();
    assert_eq!(got[0].f32s(), bi_w, "broadcast_in_dim");
    assert_eq!(got[1].f32s(), (0..24).map(|e| vs[e % 4]).collect::<Vec<_>>(), "broadcast_to");
    let mut tr_w = vec![];
    for k in 0..4 {
        for i in 0..2 {
            for j in 0..3 {
                tr_w.push(xs[(i * 3 + j) * 4 + k]);
            }
        }
    }
    assert_eq!((got[2].dims.clone(), got[2].f32s()), (vec![4, 2, 3], tr_w), "transpose");
    let sl_w: Vec<f32> = [1, 3, 5].iter().flat_map(|&r| [xs[r * 4], xs[r * 4 + 3]]).collect();
    assert_eq!((got[3].dims.clone(), got[3].f32s()), (vec![3, 2], sl_w), "slice");
    let mut cc_w = vec![];
    for i in 0..2 {
        cc_w.extend_from_slice(&xs[i * 12..i * 12 + 12]);
        for _ in 0..3 {
            cc_w.extend_from_slice(&vs);
        }
    }
    assert_eq!((got[4].dims.clone(), got[4].f32s()), (vec![2, 6, 4], cc_w), "concatenate");
    assert_eq!(got[5].f32s(), vec![-1.0, 1.0, -1.0, 2.0, -1.0, 3.0, -1.0], "pad low 1 high -1 interior 1");
    let mut rv_w = vec![];
    for i in (0..2).rev() {
        for j in 0..3 {
            for k in (0..4).rev() {
                rv_w.push(xs[(i * 3 + j) * 4 + k]);
            }
        }
    }
    assert_eq!(got[6].f32s(), rv_w, "reverse");
    Ok(())
}

#[test]
fn select_with_compare_masks() -> Result<()> {
    // Causal mask from iotas: y[i, j] = exp(x[i, j]) for j <= i, else exp(-inf) = 0;
    // plus i32/i1 logic and a broadcast compare against a threshold row.
    let mut b = FnBuilder::new("main", true);
    let x = b.arg(f32t(&[6, 6]))?;
    let thr = b.arg(f32t(&[6]))?;
    let it = TensorType::new(DType::I32, &[6, 6]);
    let row = b.iota(it.clone(), 0)?;
    let col = b.iota(it, 1)?;
    let causal = b.compare(Cmp::Le, col, row)?;
    let ninf = b.constant_f32(f32::NEG_INFINITY, f32t(&[6, 6]))?;
    let masked = b.select(causal, x, ninf)?;
    let y = b.exp(masked)?;
    let big = b.compare_bcast(Cmp::Gt, x, thr)?;
    let both = b.and(big, causal)?;
    let either = b.or(big, causal)?;
    let neither = b.not(either)?;
    let t = b.constant_bool(true, &[])?;
    let all = b.select(t, x, x)?;
    let both = b.convert(both, DType::I32)?;
    let neither = b.convert(neither, DType::I32)?;
    b.ret(&[y, both, neither, all])?;
    let xs = rand_vec(36, 13, -1.0, 1.0);
    let ts = rand_vec(6, 14, -0.5, 0.5);
    let got = run!(&module(b)?, vec![In::F32(xs.clone(), vec![6, 6]), In::F32(ts.clone(), vec![6])]);
    let yw: Vec<f32> = (0..36).map(|e| if e % 6 <= e / 6 { xs[e].exp() } else { 0.0 }).collect();
    assert_close("causal exp", &got[0].f32s(), &yw, 1e-6);
    let bw: Vec<i32> = (0..36).map(|e| (xs[e] > ts[e % 6] && e % 6 <= e / 6) as i32).collect();
    assert_eq!(got[1].i32s(), bw, "and");
    let nw: Vec<i32> = (0..36).map(|e| !(xs[e] > ts[e % 6] || e % 6 <= e / 6) as i32).collect();
    assert_eq!(got[2].i32s(), nw, "not(or)");
    assert_eq!(got[3].f32s(), xs, "scalar pred select");
    Ok(())
}

#[test]
fn bitcast_and_convert() -> Result<()> {
    let mut b = FnBuilder::new("main", true);
    let bits32 = b.arg(TensorType::new(DType::I32, &[5]))?;
    let x = b.arg(f32t(&[5]))?;
    let u = b.convert(bits32, DType::U16)?;
    let bf = b.bitcast_convert(u, DType::BF16)?;
    let f = b.convert(bf, DType::F32)?;
    let xb = b.convert(x, DType::BF16)?;
    let back = b.bitcast_convert(xb, DType::U16)?;
    let back32 = b.convert(back, DType::I32)?;
    let half_bf = b.constant_f32(0.5, TensorType::new(DType::BF16, &[5]))?;
    let scaled = b.mul(bf, half_bf)?;
    let ints = b.convert(x, DType::I32)?;
    let bmax = b.reduce_max(bf, &[0])?;
    b.ret(&[f, back32, scaled, ints, bmax])?;
    let vals = [1.0f32, -2.5, 3.140625, 1.0e-3, -65504.0];
    let bits: Vec<u16> = vals.iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect();
    let xs = vec![1.7f32, -0.3, 100.2, 2.5, -7.9];
    let got = run!(
        &module(b)?,
        vec![In::I32(bits.iter().map(|&b| b as i32).collect(), vec![5]), In::F32(xs.clone(), vec![5])],
    );
    let want: Vec<f32> = bits.iter().map(|&b| half::bf16::from_bits(b).to_f32()).collect();
    assert_eq!(got[0].f32s(), want, "u16 -> bf16 -> f32");
    let bw: Vec<i32> = xs.iter().map(|&v| half::bf16::from_f32(v).to_bits() as i32).collect();
    assert_eq!(got[1].i32s(), bw, "f32 -> bf16 bits (round to nearest even)");
    assert_eq!(got[2].f32s(), want.iter().map(|v| v * 0.5).collect::<Vec<_>>(), "bf16 output");
    assert_eq!(got[3].i32s(), vec![1, 0, 100, 2, -7], "f32 -> i32 truncates");
    assert_eq!(got[4].f32s(), vec![3.140625], "bf16 reduce_max (init 0xFF80)");
    Ok(())
}

#[test]
fn call_and_alias() -> Result<()> {
    let mut helper = FnBuilder::new("axpy", false);
    let a = helper.arg(f32t(&[4]))?;
    let y = helper.arg(f32t(&[4]))?;
    let ax = helper.mul_const(a, 2.0)?;
    let r = helper.add(ax, y)?;
    helper.ret(&[r])?;
    let mut main = FnBuilder::new("main", true);
    let s = main.arg_aliased(f32t(&[4]), 0)?;
    let k = main.arg(f32t(&[4]))?;
    let out = main.call("axpy", &[k, s], &[f32t(&[4])])?;
    main.ret(&[out[0], k])?;
    let mut m = Module::named("kda_test")?;
    m.add(helper)?;
    m.add(main)?;
    let got =
        run!(&m.to_text(), vec![In::F32(vec![1.0, 2.0, 3.0, 4.0], vec![4]), In::F32(vec![1.0; 4], vec![4])]);
    assert_eq!(got[0].f32s(), vec![3.0, 4.0, 5.0, 6.0]);
    assert_eq!(got[1].f32s(), vec![1.0; 4]);
    Ok(())
}

// The building blocks come from `op::xla::parts` (the `harness` feature).
#[cfg(feature = "harness")]
#[test]
fn floor_products_compute_the_forward_products() -> Result<()> {
    // The profiling parts that time the forward's products alone: the WY pair is `M V` and
    // `M K` per chunk, and the whole set has the grams' six tile products, the WY pair and the
    // loop's five products.
    let (n, c, k) = (2usize, 64usize, 8usize);
    let tok = |seed| In::F32(rand_vec(n * c * k, seed, -1.0, 1.0), vec![n as i64, c as i64, k as i64]);
    let m = rand_vec(n * c * c, 9, -1.0, 1.0);
    let v = rand_vec(n * c * k, 3, -1.0, 1.0);
    let inputs = || {
        vec![
            tok(1),
            tok(2),
            In::F32(v.clone(), vec![n as i64, c as i64, k as i64]),
            tok(4),
            In::F32(vec![0.5; n * c], vec![n as i64, c as i64, 1]),
            In::F32(m.clone(), vec![n as i64, c as i64, c as i64]),
        ]
    };
    let wy = run!(&kda_tpu::op::parts::program("products_wy", n as i64, k as i64)?, inputs());
    let mut want = vec![0.0f32; n * c * k];
    for b in 0..n {
        for i in 0..c {
            for j in 0..k {
                let acc: f64 =
                    (0..c).map(|p| m[(b * c + i) * c + p] as f64 * v[(b * c + p) * k + j] as f64).sum();
                want[(b * c + i) * k + j] = acc as f32;
            }
        }
    }
    assert_close("M V", &wy[0].f32s(), &want, 1e-5);
    let all = run!(&kda_tpu::op::parts::program("products", n as i64, k as i64)?, inputs());
    assert_eq!(all.len(), 6 + 2 + 5);
    let flops = kda_tpu::op::parts::product_flops("products", 128, 128).unwrap_or(0.0);
    assert!((1.3e9..1.4e9).contains(&flops), "forward products at the primary shape: {flops}");
    Ok(())
}
