//! The testkit's full conformance suite on the PJRT backend (the CPU plugin unless
//! `KDA_PJRT_PLUGIN` names another).

kda_testkit::conformance_suite!(kda_tpu::PjrtBackend::new().expect("PJRT plugin (run `cargo xtask setup`)"));

/// A tensor of two runs by name, `None` where a run has none.
type Pair<'a> = (&'static str, Option<&'a kda_core::HostTensor>, Option<&'a kda_core::HostTensor>);

/// Each output and gradient of two runs by name.
fn paired<'a>(
    (o1, g1): (&'a kda_core::KdaOutputs, &'a kda_core::KdaGradients),
    (o2, g2): (&'a kda_core::KdaOutputs, &'a kda_core::KdaGradients),
) -> Vec<Pair<'a>> {
    vec![
        ("o", Some(&o1.o), Some(&o2.o)),
        ("final_state", o1.final_state.as_ref(), o2.final_state.as_ref()),
        ("dq", Some(&g1.dq), Some(&g2.dq)),
        ("dk", Some(&g1.dk), Some(&g2.dk)),
        ("dv", Some(&g1.dv), Some(&g2.dv)),
        ("dg", Some(&g1.dg), Some(&g2.dg)),
        ("dbeta", Some(&g1.dbeta), Some(&g2.dbeta)),
        ("dh0", g1.dh0.as_ref(), g2.dh0.as_ref()),
        ("da_log", g1.da_log.as_ref(), g2.da_log.as_ref()),
        ("ddt_bias", g1.ddt_bias.as_ref(), g2.ddt_bias.as_ref()),
    ]
}

mod mixed_dtypes {
    use kda_core::DType;
    use rstest::rstest;

    /// A gate in another dtype than the activations (an f32 `g` beside bf16 q, k, v keeps its
    /// precision; a bf16 one beside f32 activations is read as bf16): the programs read `g`
    /// in its own dtype and return `dg` in it.
    #[rstest]
    #[case::bf16_activations_f32_gate("fixed_small", DType::BF16, DType::F32)]
    #[case::f32_activations_bf16_gate("fixed_small", DType::F32, DType::BF16)]
    #[case::packed_bf16_activations_f32_gate("packed_lengths_1_63_64_65_0", DType::BF16, DType::F32)]
    #[case::in_kernel_gate_f32_gate("gate_lower_bound_l2norm", DType::BF16, DType::F32)]
    fn gate_in_its_own_dtype(#[case] name: &str, #[case] dtype: DType, #[case] g_dtype: DType) {
        let be = kda_tpu::PjrtBackend::new().expect("PJRT plugin (run `cargo xtask setup`)");
        match kda_testkit::conformance::mixed_gate_dtype(&be, name, dtype, g_dtype) {
            Ok(report) => eprint!("{report}"),
            Err(failure) => panic!("conformance failure:\n{failure}"),
        }
    }

    /// Gate parameters' gradients come back in their own inputs' dtypes: `da_log` in
    /// `a_log`'s, `ddt_bias` in `dt_bias`'s (here bf16 beside an f32 `a_log`).
    #[test]
    fn gate_parameter_gradients_keep_their_dtypes() {
        use kda_core::{BackwardStrategy, GateMode};
        let be = kda_tpu::PjrtBackend::new().expect("PJRT plugin (run `cargo xtask setup`)");
        let case = kda_testkit::cases::case("gate_softplus").expect("case");
        let mut data = kda_testkit::inputs::case_data(&case, DType::F32).expect("inputs");
        let Some((Some(a_log), Some(dt_bias))) = data.inputs.gate.params() else {
            panic!("gate_softplus has a_log and dt_bias")
        };
        let gate = GateMode::softplus(a_log.clone(), Some(dt_bias.cast(DType::BF16).expect("float cast")));
        data.inputs.gate = gate;
        let (_, grads) = be
            .forward_and_vjp(&data.inputs, &data.cotangents, BackwardStrategy::SavedState)
            .expect("fused forward+VJP");
        assert_eq!(grads.da_log.as_ref().map(|t| t.dtype()), Some(DType::F32));
        assert_eq!(grads.ddt_bias.as_ref().map(|t| t.dtype()), Some(DType::BF16));
    }
}

/// The gate gradients under strong decay (`kda_testkit::cases::strong_decay_gate_case`), f32:
/// `dg` row by row against each row's own size, `da_log` and `ddt_bias` at 1e-4, with initial
/// states and `dht`, fixed (K = 256) and packed (segments of 1, 63, 0 and 30 tokens), in the CPU
/// configuration and in slabs (the TPU configuration), both strategies, split and fused, and on
/// the TPU kernels. Every program forms `dg` in one function, so one case per configuration
/// covers them.
mod gate_gradients {
    use kda_core::BackwardStrategy;
    use kda_testkit::conformance::{gate_gradients, Path};
    use rstest::rstest;

    use BackwardStrategy::{Rematerialize as Remat, SavedState as Saved};

    /// `strong_decay_rows` on every configuration; each in-kernel gate case on one of them.
    #[rstest]
    #[case::rows_saved_fused("strong_decay_rows", false, Saved, Path::Fused)]
    #[case::rows_remat_split("strong_decay_rows", false, Remat, Path::Split)]
    #[case::rows_slabs_saved_split("strong_decay_rows", true, Saved, Path::Split)]
    #[case::rows_slabs_remat_fused("strong_decay_rows", true, Remat, Path::Fused)]
    #[case::k256_softplus_saved_fused("strong_decay_k256_softplus", false, Saved, Path::Fused)]
    #[case::k256_lower_bound_slabs_remat_fused(
        "strong_decay_k256_lower_bound_l2norm",
        true,
        Remat,
        Path::Fused
    )]
    #[case::packed_edges_softplus_slabs_saved_split(
        "strong_decay_packed_edges_softplus",
        true,
        Saved,
        Path::Split
    )]
    #[case::packed_edges_lower_bound_remat_split(
        "strong_decay_packed_edges_lower_bound_l2norm",
        false,
        Remat,
        Path::Split
    )]
    fn under_strong_decay(
        #[case] name: &str,
        #[case] slabs: bool,
        #[case] strategy: BackwardStrategy,
        #[case] path: Path,
    ) {
        let mut be = kda_tpu::PjrtBackend::new().expect("PJRT plugin (run `cargo xtask setup`)");
        if slabs {
            let tuning = be.tuning().with_slab(kda_tpu::op::TPU_SLAB);
            be = be.with_tuning(tuning).expect("a tuning");
        }
        match gate_gradients(&be, name, strategy, path) {
            Ok(report) => eprint!("{report}"),
            Err(failure) => panic!("gate gradient failure:\n{failure}"),
        }
    }

    /// The same on the TPU kernels through their interpret lowering (their own `dg` fold).
    #[rstest]
    #[case::rows_saved_fused("strong_decay_rows", Saved, Path::Fused)]
    #[case::k256_lower_bound_remat_split("strong_decay_k256_lower_bound_l2norm", Remat, Path::Split)]
    fn on_the_kernels_under_strong_decay(
        #[case] name: &str,
        #[case] strategy: BackwardStrategy,
        #[case] path: Path,
    ) {
        match gate_gradients(&super::interpret::backend(), name, strategy, path) {
            Ok(report) => eprint!("{report}"),
            Err(failure) => panic!("gate gradient failure:\n{failure}"),
        }
    }
}

/// The suite compiles at `$KDA_XLA_OPT_LEVEL` (0 under `cargo xtask test`: XLA's HLO passes as
/// always, unoptimized CPU code generation); these cases compile at XLA's default level 3, the
/// one users run, and meet the same limits: the forward and the fused forward+VJP, fixed and
/// packed, both strategies, both dtypes, the in-kernel gate.
mod optimized_codegen {
    use kda_core::{BackwardStrategy, DType};
    use kda_testkit::conformance::{backward, forward, Path};
    use kda_tpu::{PjrtOptions, XlaOption};
    use rstest::rstest;

    use BackwardStrategy::{Rematerialize as Remat, SavedState as Saved};
    use DType::{BF16, F32};

    #[rstest]
    #[case::fixed_batch_first_f32_saved("fixed_batch_first_b2", F32, Saved)]
    #[case::packed_bf16_remat("packed_lengths_1_63_64_65_0", BF16, Remat)]
    #[case::in_kernel_gate_bf16_saved("gate_lower_bound_l2norm", BF16, Saved)]
    fn level_3_meets_the_limits(
        #[case] name: &str,
        #[case] dtype: DType,
        #[case] strategy: BackwardStrategy,
    ) {
        let be = PjrtOptions::new()
            .xla_option("xla_backend_optimization_level", XlaOption::Int(3))
            .build()
            .expect("PJRT plugin (run `cargo xtask setup`)");
        for report in [forward(&be, name, dtype), backward(&be, name, dtype, strategy, Path::Fused)] {
            match report {
                Ok(report) => eprint!("{report}"),
                Err(failure) => panic!("conformance failure at level 3:\n{failure}"),
            }
        }
    }
}

/// Data parallelism (`PjrtOptions::devices`): the batch's rows spread over 2, 3 and 4 CPU
/// devices, one program compiled for that many replicas, the gate-parameter gradients
/// all-reduced in it. Each case meets the limits of docs/kda.md, Accuracy against the reference and agrees with
/// the single-device program within docs/kda.md Context parallelism's (RMS ratio 1e-6 for f32 outputs and
/// gradients). Devices beyond the batch's rows hold padding rows only (B = 2 on 3 or 4 devices).
mod data_parallel {
    use kda_core::{BackwardStrategy, DType, HostTensor};
    use kda_testkit::cases::{case, Case, CaseGate, CaseSegments};
    use kda_testkit::conformance::{backward_case, Path};
    use kda_tpu::{PjrtBackend, PjrtOptions};
    use rstest::rstest;

    use BackwardStrategy::{Rematerialize as Remat, SavedState as Saved};
    use DType::{BF16, F32};
    use Path::{Fused, Split};

    /// A table case, `softplus_b3` (three rows with an in-kernel softplus gate: the
    /// all-reduced `da_log` and `ddt_bias` sum rows of every device) or `packed_rows_b5` (five
    /// packed rows holding 1 to 5 non-empty segments of N = 5).
    pub(crate) fn named(name: &str) -> Case {
        match name {
            "softplus_b3" => Case {
                name: "softplus_b3",
                b: 3,
                gate: CaseGate::Softplus,
                ..case("gate_softplus").expect("case")
            },
            "packed_rows_b5" => Case {
                name: "packed_rows_b5",
                b: 5,
                segments: CaseSegments::Lengths(vec![
                    vec![30, 70, 28, 0, 0],
                    vec![100, 0, 40, 0, 0],
                    vec![5, 0, 0, 0, 0],
                    vec![64, 64, 12, 0, 0],
                    vec![1, 2, 3, 4, 5],
                ]),
                ..case("packed_rows_differ").expect("case")
            },
            other => case(other).expect("case"),
        }
    }

    /// The RMS ratio (docs/kda.md, Accuracy) of `got` against `want` (the testkit's metric).
    fn rms_ratio(got: &HostTensor, want: &HostTensor) -> f64 {
        kda_testkit::metrics::agreement(got, &want.to_f64_vec()).rms_ratio
    }

    #[rstest]
    #[case::d2_fixed_batch_first_fused_saved(2, "fixed_batch_first_b2", F32, Saved, Fused)]
    #[case::d3_fixed_batch_first_split_remat(3, "fixed_batch_first_b2", BF16, Remat, Split)]
    #[case::d4_single_head_split_saved(4, "single_head_b2", F32, Saved, Split)]
    #[case::d2_packed_rows_differ_split_remat(2, "packed_rows_differ", F32, Remat, Split)]
    #[case::d3_packed_rows_differ_fused_saved(3, "packed_rows_differ", F32, Saved, Fused)]
    #[case::d4_packed_segment_ids_fused_remat(4, "packed_segment_ids", BF16, Remat, Fused)]
    #[case::d2_packed_segment_ids_split_saved(2, "packed_segment_ids", BF16, Saved, Split)]
    #[case::d2_softplus_b3_fused_remat(2, "softplus_b3", F32, Remat, Fused)]
    #[case::d3_softplus_b3_split_saved(3, "softplus_b3", F32, Saved, Split)]
    #[case::d4_softplus_b3_fused_saved(4, "softplus_b3", BF16, Saved, Fused)]
    #[case::d3_packed_rows_b5_fused_remat(3, "packed_rows_b5", F32, Remat, Fused)]
    #[case::d4_beta_trailing_one_split_remat(4, "beta_trailing_one", F32, Remat, Split)]
    fn rows_over_devices_meet_the_reference(
        #[case] devices: usize,
        #[case] name: &str,
        #[case] dtype: DType,
        #[case] strategy: BackwardStrategy,
        #[case] path: Path,
    ) {
        let be = PjrtOptions::new().devices(devices).build().expect("PJRT plugin (run `cargo xtask setup`)");
        assert_eq!(be.device_count(), devices);
        match backward_case(&be, &named(name), dtype, strategy, path) {
            Ok(report) => eprint!("{report}"),
            Err(failure) => panic!("conformance failure on {devices} devices:\n{failure}"),
        }
    }

    /// f32, fused saved-state: every output and gradient of the spread batch within RMS ratio
    /// 1e-6 of the single-device program's (the same per-row programs; only the gate-parameter
    /// sums are added in another order).
    #[rstest]
    #[case::d2_softplus_b3(2, "softplus_b3")]
    #[case::d4_packed_rows_b5(4, "packed_rows_b5")]
    fn rows_over_devices_agree_with_one_device(#[case] devices: usize, #[case] name: &str) {
        let data = kda_testkit::inputs::case_data(&named(name), F32).expect("inputs");
        let one = PjrtBackend::new().expect("PJRT plugin");
        let many = PjrtOptions::new().devices(devices).build().expect("PJRT plugin");
        let (o1, g1) = one.forward_and_vjp(&data.inputs, &data.cotangents, Saved).expect("one device");
        let (od, gd) = many.forward_and_vjp(&data.inputs, &data.cotangents, Saved).expect("devices");
        for (what, got, want) in super::paired((&od, &gd), (&o1, &g1)) {
            match (got, want) {
                (Some(g), Some(w)) => {
                    assert_eq!(g.shape(), w.shape(), "{what}");
                    let r = rms_ratio(g, w);
                    eprintln!("{name} on {devices} devices: {what} RMS ratio {r:.2e} against one device");
                    assert!(r <= 1e-6, "{what}: RMS ratio {r:.3e} against the single-device program");
                }
                (None, None) => {}
                _ => panic!("{what}: present on one side only"),
            }
        }
    }
}

/// The device API with one shard per device (`to_device(.., d)`, then the same calls on the
/// shards): each device's results stay there and equal, bitwise, the rows the host call returns
/// for the same spread; `da_log` and `ddt_bias` are the whole batch's sums on every device.
/// Misplaced or misshapen shards are errors that name the device.
mod device_shards {
    use kda_core::{BackwardStrategy, Cotangents, DType, HostTensor, KdaInputs};
    use kda_tpu::{DeviceCotangents, PjrtBackend, PjrtOptions};
    use rstest::rstest;

    /// Row `r` of a case's inputs and cotangents (head-first: the batch is axis 1).
    fn row(x: &KdaInputs, c: &Cotangents, r: usize) -> (KdaInputs, Cotangents) {
        let take = |t: &HostTensor, axis: usize| t.slice_padded(axis, r, 1).expect("row");
        let inputs = KdaInputs {
            q: take(&x.q, 1),
            k: take(&x.k, 1),
            v: take(&x.v, 1),
            g: take(&x.g, 1),
            beta: take(&x.beta, 1),
            initial_state: x.initial_state.as_ref().map(|t| take(t, 0)),
            ..x.clone()
        };
        let cot = Cotangents { d_o: take(&c.d_o, 1), dht: c.dht.as_ref().map(|t| take(t, 0)) };
        (inputs, cot)
    }

    fn host(be: &PjrtBackend, t: &kda_tpu::DeviceTensor) -> HostTensor {
        be.to_host(t).expect("download")
    }

    #[test]
    fn shards_on_their_devices_match_the_host_call() {
        let devices = 3;
        let case = super::data_parallel::named("softplus_b3");
        assert_eq!(case.layout, kda_core::Layout::HeadFirst);
        let data = kda_testkit::inputs::case_data(&case, DType::F32).expect("inputs");
        let be = PjrtOptions::new().devices(devices).build().expect("PJRT plugin (run `cargo xtask setup`)");
        let (o_host, g_host) = be
            .forward_and_vjp(&data.inputs, &data.cotangents, BackwardStrategy::SavedState)
            .expect("host call");
        let (mut xs, mut cs) = (Vec::new(), Vec::new());
        for d in 0..devices {
            let (x, c) = row(&data.inputs, &data.cotangents, d);
            xs.push(be.to_device(&x, d).expect("upload"));
            cs.push(be.to_device(&c, d).expect("upload"));
        }
        let (outs, grads) = be.forward_and_vjp(&xs, &cs, BackwardStrategy::SavedState).expect("device call");
        for (d, (out, grads)) in outs.iter().zip(&grads).enumerate() {
            assert_eq!(out.o.device(), d);
            assert_eq!(grads.dq.device(), d);
            assert_eq!(host(&be, &out.o), o_host.o.slice_padded(1, d, 1).unwrap(), "o of device {d}");
            assert_eq!(host(&be, &grads.dk), g_host.dk.slice_padded(1, d, 1).unwrap(), "dk of device {d}");
            let da = grads.da_log.as_ref().expect("da_log");
            assert_eq!(Some(host(&be, da)), g_host.da_log.clone(), "da_log of device {d}");
        }

        // The forward and backward pair agrees with the fused call.
        let (_, res) = be.forward(&xs, BackwardStrategy::Rematerialize).expect("forward");
        let grads = be.backward(&res, &cs).expect("backward");
        for (d, g) in grads.iter().enumerate() {
            let r = kda_testkit::metrics::agreement(
                &host(&be, &g.dv),
                &g_host.dv.slice_padded(1, d, 1).unwrap().to_f64_vec(),
            )
            .rms_ratio;
            assert!(r <= 1e-6, "dv of device {d}: RMS ratio {r:.2e} against the fused host call");
        }

        // Errors: a shard missing, a shard on the wrong device, a device the handle lacks.
        let err = be.forward_and_vjp(&xs[..2], &cs[..2], BackwardStrategy::SavedState).unwrap_err();
        assert!(err.to_string().contains("one shard per device (3)"), "{err}");
        let swapped = [xs[1].clone(), xs[0].clone(), xs[2].clone()];
        let err = be.forward(&swapped[..], BackwardStrategy::SavedState).unwrap_err();
        assert!(err.to_string().contains("device 0") && err.to_string().contains("device 1"), "{err}");
        let err = be.to_device(&row(&data.inputs, &data.cotangents, 0).0, devices).unwrap_err();
        assert!(err.to_string().contains("below 3"), "{err}");

        // A one-device call runs on whichever device its tensors are: device 1's row there.
        let (out, _) = be.forward(&xs[1], BackwardStrategy::SavedState).expect("one call on device 1");
        assert_eq!(out.o.device(), 1);
        assert_eq!(host(&be, &out.o), o_host.o.slice_padded(1, 1, 1).unwrap(), "o of device 1 alone");
    }

    /// The device training loop: each shard's `o` fed back as its own `do` (flat program
    /// results reshaped on their device), for both strategies; the gradients are bitwise those
    /// of the same residuals' backward from the host copy of `o`.
    #[rstest]
    #[case::saved_state(BackwardStrategy::SavedState)]
    #[case::remat(BackwardStrategy::Rematerialize)]
    fn shards_take_their_own_outputs_as_cotangents(#[case] strategy: BackwardStrategy) {
        let devices = 3;
        let case = super::data_parallel::named("softplus_b3");
        let data = kda_testkit::inputs::case_data(&case, DType::F32).expect("inputs");
        let be = PjrtOptions::new().devices(devices).build().expect("PJRT plugin (run `cargo xtask setup`)");
        let xs: Vec<_> = (0..devices)
            .map(|d| be.to_device(&row(&data.inputs, &data.cotangents, d).0, d).expect("upload"))
            .collect();
        let (outs, res) = be.forward(&xs, strategy).expect("forward");
        let cots: Vec<DeviceCotangents> =
            outs.iter().map(|o| Cotangents { d_o: o.o.clone(), dht: None }).collect();
        let grads = be.backward(&res, &cots).expect("backward from do = o");
        let o_host: Vec<HostTensor> = outs.iter().map(|o| host(&be, &o.o)).collect();
        let d_o = HostTensor::concat(&o_host, 1).expect("whole batch");
        let want = be.backward(&res, &Cotangents { d_o, dht: None }).expect("backward from host do");
        for (d, g) in grads.iter().enumerate() {
            assert_eq!(g.dq.device(), d);
            assert_eq!(host(&be, &g.dq), want.dq.slice_padded(1, d, 1).unwrap(), "dq of device {d}");
            assert_eq!(host(&be, &g.dg), want.dg.slice_padded(1, d, 1).unwrap(), "dg of device {d}");
        }
        // The same loop on one device (device 2), its residuals borrowed twice.
        let (out, res) = be.forward(&xs[2], strategy).expect("forward on device 2");
        let a = be.backward(&res, &Cotangents { d_o: out.o.clone(), dht: None }).expect("backward");
        let b = be.backward(&res, &Cotangents { d_o: host(&be, &out.o), dht: None }).expect("backward");
        assert_eq!(a.dq.device(), 2);
        assert_eq!(host(&be, &a.dq), b.dq, "device do and host do give the same bits");
    }
}

/// Context parallelism (`Split::Context`): every row's chunks cut into one piece per device
/// (2, 3 or 4), each device holding its piece's tokens only, the pieces' state transitions
/// exchanged inside the one program. Each case meets the limits of docs/kda.md, Accuracy against the reference;
/// the placements of docs/kda.md, Context parallelism are covered: a segment inside one piece, crossing one
/// boundary, spanning several pieces, pieces of padding only and empty pieces, with initial
/// and final states.
mod context_parallel {
    use kda_core::{BackwardStrategy, DType, HostTensor};
    use kda_testkit::cases::{case, Case, CaseSegments, Profile};
    use kda_testkit::conformance::{backward_case, Path};
    use kda_tpu::{PjrtBackend, PjrtOptions, Split};
    use rstest::rstest;

    use BackwardStrategy::{Rematerialize as Remat, SavedState as Saved};
    use DType::{BF16, F32};
    use Path::{Fused, Split as Staged};

    /// Table cases and rows built for the piece boundaries, all with long memory (log-decays
    /// near 0): a piece's entering state then shapes its outputs, so a wrong exchange fails.
    pub(crate) fn named(name: &str) -> Case {
        let packed = |name: &'static str, t: usize, rows: Vec<Vec<usize>>| Case {
            name,
            t,
            b: rows.len(),
            segments: CaseSegments::Lengths(rows),
            ..case("packed_rows_differ").expect("case")
        };
        let base = named_base(name, packed);
        Case { profile: Profile::LongMemory, ..base }
    }

    fn named_base(name: &str, packed: impl Fn(&'static str, usize, Vec<Vec<usize>>) -> Case) -> Case {
        match name {
            // 200 tokens: one segment spanning every piece.
            "span_200" => Case { name: "span_200", t: 200, ..case("fixed_small").expect("case") },
            // Segments inside a piece, across one boundary, an empty one, trailing padding.
            "mixed_rows" => packed("mixed_rows", 300, vec![vec![30, 100, 0, 130], vec![200, 64, 10, 0]]),
            // Fewer chunks than devices: the last pieces hold nothing.
            "short_row" => packed("short_row", 70, vec![vec![5, 60, 0, 0]]),
            // K != V (24, 40), batch-first: the exchanged [Q | P] blocks have unequal widths.
            "k_ne_v_200" => Case { name: "k_ne_v_200", t: 200, ..case("k_ne_v").expect("case") },
            other => case(other).expect("case"),
        }
    }

    /// Options of a context-parallel backend over `devices` CPU devices.
    fn options(devices: usize) -> PjrtOptions {
        PjrtOptions::new().devices(devices).split(Split::Context)
    }

    pub(crate) fn backend(devices: usize) -> PjrtBackend {
        built(options(devices))
    }

    fn built(options: PjrtOptions) -> PjrtBackend {
        options.build().expect("PJRT plugin (run `cargo xtask setup`)")
    }

    /// One conformance case on `be`; `what` names the configuration in a failure.
    fn meets_the_reference(
        be: &PjrtBackend,
        what: &str,
        name: &str,
        dtype: DType,
        strategy: BackwardStrategy,
        path: Path,
    ) {
        match backward_case(be, &named(name), dtype, strategy, path) {
            Ok(report) => eprint!("{report}"),
            Err(failure) => panic!("conformance failure {what}:\n{failure}"),
        }
    }

    #[rstest]
    #[case::d2_fixed_fused_saved(2, "l2norm_preactivated", F32, Saved, Fused)]
    #[case::d4_span_fused_remat(4, "span_200", F32, Remat, Fused)]
    #[case::d3_span_split_saved(3, "span_200", BF16, Saved, Staged)]
    #[case::d2_mixed_split_remat(2, "mixed_rows", F32, Remat, Staged)]
    #[case::d3_mixed_fused_saved(3, "mixed_rows", F32, Saved, Fused)]
    #[case::d4_mixed_split_saved(4, "mixed_rows", BF16, Saved, Staged)]
    #[case::d4_short_row_fused_saved(4, "short_row", F32, Saved, Fused)]
    #[case::d2_softplus_split_remat(2, "gate_softplus", F32, Remat, Staged)]
    #[case::d3_lower_bound_fused_remat(3, "gate_lower_bound_l2norm", BF16, Remat, Fused)]
    #[case::d2_batch_first_fused_remat(2, "fixed_batch_first_b2", BF16, Remat, Fused)]
    #[case::d3_segment_ids_split_remat(3, "packed_segment_ids", F32, Remat, Staged)]
    #[case::d4_k_ne_v_split_saved(4, "k_ne_v_200", F32, Saved, Staged)]
    fn pieces_over_devices_meet_the_reference(
        #[case] devices: usize,
        #[case] name: &str,
        #[case] dtype: DType,
        #[case] strategy: BackwardStrategy,
        #[case] path: Path,
    ) {
        meets_the_reference(&backend(devices), &format!("on {devices} devices"), name, dtype, strategy, path);
    }

    /// Every piece on the Mosaic kernels (their interpret lowering), the exchange XLA's
    /// collectives around them.
    #[rstest]
    #[case::d2_mixed_fused_saved(2, "mixed_rows", F32, Saved, Fused)]
    #[case::d3_lower_bound_split_remat(3, "gate_lower_bound_l2norm", BF16, Remat, Staged)]
    fn kernel_pieces_over_devices_meet_the_reference(
        #[case] devices: usize,
        #[case] name: &str,
        #[case] dtype: DType,
        #[case] strategy: BackwardStrategy,
        #[case] path: Path,
    ) {
        let tuning = kda_tpu::Tuning::default().with_implementation(kda_tpu::Implementation::Interpret);
        let be = built(options(devices).tuning(tuning));
        meets_the_reference(
            &be,
            &format!("of the kernels on {devices} devices"),
            name,
            dtype,
            strategy,
            path,
        );
    }

    /// The TPU configuration on the CPU plugin: programs in slabs of 1 chunk position, whose
    /// backward transitions run the slabbed fused remat program.
    #[rstest]
    #[case::d2_mixed_fused_saved(2, "mixed_rows", F32, Saved, Fused)]
    #[case::d3_span_split_remat(3, "span_200", BF16, Remat, Staged)]
    fn pieces_in_slabs_meet_the_reference(
        #[case] devices: usize,
        #[case] name: &str,
        #[case] dtype: DType,
        #[case] strategy: BackwardStrategy,
        #[case] path: Path,
    ) {
        let be = built(
            options(devices).tuning(kda_tpu::Tuning::from_env().expect("KDA_IMPLEMENTATION").with_slab(1)),
        );
        meets_the_reference(&be, &format!("on {devices} devices in slabs"), name, dtype, strategy, path);
    }

    /// The RMS ratio (docs/kda.md, Accuracy) of `got` against `want` (the testkit's metric).
    fn rms_ratio(got: &HostTensor, want: &HostTensor) -> f64 {
        kda_testkit::metrics::agreement(got, &want.to_f64_vec()).rms_ratio
    }

    /// f32, fused saved-state: o and the final states within RMS ratio 1e-6 of the
    /// single-device program's, every gradient within max(1e-6, 2x the single-device program's
    /// own ratio against the reference) of it (docs/kda.md, Context parallelism).
    #[rstest]
    #[case::d2_mixed_rows(2, "mixed_rows")]
    #[case::d4_span_200(4, "span_200")]
    fn pieces_over_devices_agree_with_one_device(#[case] devices: usize, #[case] name: &str) {
        let case = named(name);
        let data = kda_testkit::inputs::case_data(&case, F32).expect("inputs");
        let one = PjrtBackend::new().expect("PJRT plugin");
        let (o1, g1) = one.forward_and_vjp(&data.inputs, &data.cotangents, Saved).expect("one device");
        let (od, gd) =
            backend(devices).forward_and_vjp(&data.inputs, &data.cotangents, Saved).expect("devices");
        let reference =
            kda_testkit::reference::forward_and_vjp(&format!("{name}-f32"), &data).expect("reference");
        let outputs = [
            ("o", Some(&od.o), Some(&o1.o)),
            ("final_state", od.final_state.as_ref(), o1.final_state.as_ref()),
        ];
        for (what, got, want) in outputs {
            if let (Some(g), Some(w)) = (got, want) {
                let r = rms_ratio(g, w);
                eprintln!("{name} on {devices} devices: {what} {r:.2e} against one device");
                assert!(r <= 1e-6, "{what}: RMS ratio {r:.3e} against the single-device program");
            }
        }
        let want = &reference.1;
        let grads = [
            ("dq", Some(&gd.dq), Some(&g1.dq), Some(&want.dq)),
            ("dk", Some(&gd.dk), Some(&g1.dk), Some(&want.dk)),
            ("dv", Some(&gd.dv), Some(&g1.dv), Some(&want.dv)),
            ("dg", Some(&gd.dg), Some(&g1.dg), Some(&want.dg)),
            ("dbeta", Some(&gd.dbeta), Some(&g1.dbeta), Some(&want.dbeta)),
            ("dh0", gd.dh0.as_ref(), g1.dh0.as_ref(), want.dh0.as_ref()),
        ];
        for (what, got, one, reference) in grads {
            if let (Some(g), Some(w), Some(r)) = (got, one, reference) {
                let own = rms_ratio(w, r);
                let limit = (2.0 * own).max(1e-6);
                let ratio = rms_ratio(g, w);
                eprintln!(
                    "{name} on {devices} devices: {what} {ratio:.2e} against one device (limit {limit:.2e})"
                );
                assert!(
                    ratio <= limit,
                    "{what}: RMS ratio {ratio:.3e} against one device, limit {limit:.3e}"
                );
            }
        }
    }
}

/// The GPU kernels through their interpret lowering with a GPU's numerics
/// (`Implementation::TritonInterpret`: the kernels XLA's CUDA plugin compiles, as plain
/// StableHLO) against the reference at the limits of docs/kda.md, Accuracy: a covering set of
/// the forward (fixed and packed, both layouts, widths padded to the kernels' powers of two, K
/// up to 256, the in-kernel gates and L2 norm, hard resets, every segment empty) and of the
/// backward (the GPU backward kernels, from the kernels' forward), bitwise causality at a
/// boundary inside a sub-chunk, segment isolation; the rest of the table under `full::`.
mod triton_interpret {
    use kda_core::{BackwardStrategy, DType, HostTensor, Layout};
    use kda_testkit::conformance::{backward, forward, Path};
    use kda_testkit::{Case, CaseGate};
    use kda_tpu::{Implementation, PjrtBackend};
    use rstest::rstest;
    use BackwardStrategy::{Rematerialize, SavedState};

    use super::interpret::{forward_twice_on, grad_tokens, only_slot_changed, tokens, vjp_twice_on};
    use DType::{BF16, F32};
    use Path::{Fused, Split};

    pub fn backend() -> PjrtBackend {
        PjrtBackend::new()
            .and_then(|b| {
                b.clone().with_tuning(b.tuning().with_implementation(Implementation::TritonInterpret))
            })
            .expect("PJRT plugin (run `cargo xtask setup`)")
    }

    pub fn run(r: Result<kda_testkit::conformance::Report, String>) {
        match r {
            Ok(report) => eprint!("{report}"),
            Err(failure) => panic!("conformance failure:\n{failure}"),
        }
    }

    #[rstest]
    #[case::fixed_small_f32("fixed_small", F32)]
    #[case::batch_first_b2_bf16("fixed_batch_first_b2", BF16)]
    #[case::singleton_f32("singleton_h1_b1_t1", F32)]
    #[case::k129_v127_f32("k129_v127", F32)]
    #[case::k256_v32_bf16("k256_v32", BF16)]
    #[case::lower_bound_l2norm_bf16("gate_lower_bound_l2norm", BF16)]
    #[case::softplus_f32("gate_softplus", F32)]
    #[case::hard_reset_f32("hard_reset", F32)]
    #[case::packed_lengths_f32("packed_lengths_1_63_64_65_0", F32)]
    #[case::packed_rows_differ_bf16("packed_rows_differ", BF16)]
    #[case::packed_all_empty_f32("packed_all_empty", F32)]
    fn forward_meets_the_reference(#[case] name: &str, #[case] dtype: DType) {
        run(forward(&backend(), name, dtype));
    }

    /// Batch-first rows of whole chunks, read and written in place by the kernels (two rows,
    /// so that the state restarts at the second): pre-activated, and with the lower-bound gate
    /// and the L2 norm.
    #[rstest]
    #[case::preactivated_f32(Case { layout: Layout::BatchFirst, ..Case::base("rows_in_place", 2, 2, 128, 32, 16) }, F32)]
    #[case::lower_bound_l2norm_bf16(Case { layout: Layout::BatchFirst, gate: CaseGate::LowerBound(-5.0), l2norm: true, ..Case::base("rows_in_place_gate", 2, 2, 192, 16, 32) }, BF16)]
    fn in_place_rows_meet_the_reference(#[case] case: Case, #[case] dtype: DType) {
        run(kda_testkit::conformance::forward_case(&backend(), &case, dtype));
    }

    /// Packed rows (two of them, segments of 1, 63, 0 and 30 tokens) with the in-kernel gates:
    /// the gate parameters per head, a packed program's lanes.
    #[rstest]
    #[case::softplus_bf16("strong_decay_packed_edges_softplus", BF16)]
    #[case::lower_bound_l2norm_f32("strong_decay_packed_edges_lower_bound_l2norm", F32)]
    fn packed_rows_with_the_gate_meet_the_reference(#[case] name: &str, #[case] dtype: DType) {
        let case = kda_testkit::cases::strong_decay_gate_case(name).expect("case");
        run(kda_testkit::conformance::forward_case(&backend(), &case, dtype));
    }

    /// The backward of rows read in place, gradients written in place: the split saved-state
    /// backward from the rows' per-chunk states, the fused saved-state forward+VJP, and the
    /// rematerializing fused program with the gates and the L2 norm (the tail's gate and norm
    /// gradients in the caller's layout).
    #[rstest]
    #[case::preactivated_saved_split_f32(Case { layout: Layout::BatchFirst, ..Case::base("rows_in_place", 2, 2, 128, 32, 16) }, F32, SavedState, Split)]
    #[case::preactivated_saved_fused_f32(Case { layout: Layout::BatchFirst, ..Case::base("rows_in_place", 2, 2, 128, 32, 16) }, F32, SavedState, Fused)]
    #[case::lower_bound_l2norm_remat_fused_bf16(Case { layout: Layout::BatchFirst, gate: CaseGate::LowerBound(-5.0), l2norm: true, ..Case::base("rows_in_place_gate", 2, 2, 192, 16, 32) }, BF16, Rematerialize, Fused)]
    #[case::softplus_saved_split_f32(Case { layout: Layout::BatchFirst, gate: CaseGate::Softplus, ..Case::base("rows_in_place_softplus", 3, 2, 128, 32, 16) }, F32, SavedState, Split)]
    fn in_place_rows_backward_meets_the_reference(
        #[case] case: Case,
        #[case] dtype: DType,
        #[case] strategy: BackwardStrategy,
        #[case] path: Path,
    ) {
        run(kda_testkit::conformance::backward_case(&backend(), &case, dtype, strategy, path));
    }

    /// The backward (the state, WY and intra gradient kernels) from the GPU kernels' forward:
    /// the split saved-state backward reads the recurrence kernel's per-chunk states, the fused
    /// program its own, the rematerializing backward re-runs the forward kernels; K = 256 in two parts, every segment empty (`dh0`
    /// is `dht`). Padded widths and hard resets under `full::`.
    #[rstest]
    #[case::fixed_small_saved_split_f32("fixed_small", F32, SavedState, Split)]
    #[case::packed_rows_differ_saved_fused_bf16("packed_rows_differ", BF16, SavedState, Fused)]
    #[case::lower_bound_l2norm_remat_fused_f32("gate_lower_bound_l2norm", F32, Rematerialize, Fused)]
    #[case::packed_lengths_saved_split_f32("packed_lengths_1_63_64_65_0", F32, SavedState, Split)]
    #[case::k256_v32_saved_split_bf16("k256_v32", BF16, SavedState, Split)]
    #[case::packed_all_empty_saved_fused_f32("packed_all_empty", F32, SavedState, Fused)]
    fn backward_meets_the_reference(
        #[case] name: &str,
        #[case] dtype: DType,
        #[case] strategy: BackwardStrategy,
        #[case] path: Path,
    ) {
        run(backward(&backend(), name, dtype, strategy, path));
    }

    /// Every input of every token from `t0` on drawn again leaves each row's outputs before
    /// `t0` bitwise the same: `t0` inside a sub-chunk of the second chunk, and one token into a
    /// chunk.
    #[rstest]
    fn the_gpu_forward_is_bitwise_causal(#[values(83, 129)] t0: usize) {
        let case = kda_testkit::cases::case("fixed_batch_first_b2").expect("case");
        assert!(case.t > t0, "the case reaches token {t0}");
        let later = |_: usize, t: usize| t >= t0;
        let (case, [a, b]) = forward_twice_on(&backend(), case, &later);
        let earlier = |_: usize, t: usize| t < t0;
        assert_eq!(tokens(&a.o, &case, &earlier), tokens(&b.o, &case, &earlier), "outputs before {t0}");
        assert_ne!(tokens(&a.o, &case, &later), tokens(&b.o, &case, &later), "outputs from {t0} on");
    }

    /// Changing the tokens of one segment (row 0's second of `packed_rows_differ`) leaves every
    /// other token's output and every other segment's final state bitwise equal.
    #[test]
    fn the_gpu_forward_isolates_segments() {
        let case = kda_testkit::cases::case("packed_rows_differ").expect("case");
        let inside = |r: usize, t: usize| r == 0 && (30..100).contains(&t);
        let (case, [a, b]) = forward_twice_on(&backend(), case, &inside);
        let outside = |r: usize, t: usize| !inside(r, t);
        assert_eq!(tokens(&a.o, &case, &outside), tokens(&b.o, &case, &outside), "outputs outside");
        assert_ne!(tokens(&a.o, &case, &inside), tokens(&b.o, &case, &inside));
        let (fa, fb) = (a.final_state.expect("final states"), b.final_state.expect("final states"));
        let (fa, fb) = (fa.to_f32_vec(), fb.to_f32_vec());
        let per_slot = fa.len() / (case.b * 3);
        for (slot, (x, y)) in fa.chunks(per_slot).zip(fb.chunks(per_slot)).enumerate() {
            let same = x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits());
            assert_eq!(same, slot != 1, "final state of slot {slot}");
        }
    }

    /// Batch-first packed rows at widths the kernels take (K = 16, V = 32), which they read in
    /// place: two rows of 200 tokens, segments of 1, 63, 0 and 30 tokens, then of 40 and 60 and
    /// two empty ones (each row's trailing padding past 64 rows: written by the unused chunk
    /// positions).
    pub fn packed_in_place(name: &'static str) -> Case {
        let rows = vec![vec![1, 63, 0, 30], vec![40, 60, 0, 0]];
        Case {
            layout: Layout::BatchFirst,
            segments: kda_testkit::cases::CaseSegments::Lengths(rows),
            ..Case::base(name, 2, 2, 200, 16, 32)
        }
    }

    /// Packed rows read in place, their gradients written straight to the packed tokens: the
    /// forward and the backward against the reference (the lower-bound gate and L2 norm
    /// rematerializing in bf16, head-first rows with the softplus gate; pre-activated and
    /// softplus f32 under `full::`).
    #[rstest]
    #[case::lower_bound_l2norm_remat_fused_bf16(Case { gate: CaseGate::LowerBound(-5.0), l2norm: true, ..packed_in_place("packed_in_place_gate") }, BF16, Rematerialize, Fused)]
    #[case::head_first_softplus_remat_split_bf16(Case { gate: CaseGate::Softplus, layout: Layout::HeadFirst, ..packed_in_place("packed_in_place_head_first") }, BF16, Rematerialize, Split)]
    fn packed_rows_in_place_meet_the_reference(
        #[case] case: Case,
        #[case] dtype: DType,
        #[case] strategy: BackwardStrategy,
        #[case] path: Path,
    ) {
        packed_in_place_meets_the_reference(&case, dtype, strategy, path);
    }

    /// The forward and backward of `case` against the reference.
    pub fn packed_in_place_meets_the_reference(
        case: &Case,
        dtype: DType,
        strategy: BackwardStrategy,
        path: Path,
    ) {
        run(kda_testkit::conformance::forward_case(&backend(), case, dtype));
        run(kda_testkit::conformance::backward_case(&backend(), case, dtype, strategy, path));
    }

    /// The outputs and gradients of batch-first packed rows read in place are those of the
    /// path that gathers the same rows into aligned chunks and compacts the results back
    /// (`Tuning::with_packed_in_place(false)`), bitwise, with the lower-bound gate and the L2
    /// norm (f32, fused saved state); the padding tokens' outputs and gradients are exactly 0
    /// (head-first under `full::`).
    #[test]
    fn packed_rows_in_place_match_the_gather_path() {
        packed_in_place_matches_the_gather_path(Layout::BatchFirst);
    }

    /// [`packed_rows_in_place_match_the_gather_path`] in `layout`.
    pub fn packed_in_place_matches_the_gather_path(layout: Layout) {
        let case = Case {
            gate: CaseGate::LowerBound(-5.0),
            l2norm: true,
            layout,
            ..packed_in_place("packed_in_place_gather")
        };
        let data = kda_testkit::case_data(&case, F32).expect("inputs");
        let in_place = backend();
        let gather =
            in_place.clone().with_tuning(in_place.tuning().with_packed_in_place(false)).expect("tuning");
        let run =
            |be: &PjrtBackend| be.forward_and_vjp(&data.inputs, &data.cotangents, SavedState).expect("vjp");
        let ((out, g), (out_gather, g_gather)) = (run(&in_place), run(&gather));
        let bits = |x: &HostTensor| x.to_f32_vec().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        let some_bits = |x: &Option<HostTensor>| x.as_ref().map(bits);
        assert_eq!(bits(&out.o), bits(&out_gather.o), "o");
        assert_eq!(some_bits(&out.final_state), some_bits(&out_gather.final_state), "final states");
        for (what, x, y) in [
            ("dq", &g.dq, &g_gather.dq),
            ("dk", &g.dk, &g_gather.dk),
            ("dv", &g.dv, &g_gather.dv),
            ("dg", &g.dg, &g_gather.dg),
            ("dbeta", &g.dbeta, &g_gather.dbeta),
        ] {
            assert_eq!(bits(x), bits(y), "{what}");
        }
        assert_eq!(some_bits(&g.dh0), some_bits(&g_gather.dh0), "dh0");
        assert_eq!(some_bits(&g.da_log), some_bits(&g_gather.da_log), "da_log");
        assert_eq!(some_bits(&g.ddt_bias), some_bits(&g_gather.ddt_bias), "ddt_bias");
        // Rows 0 and 1 end at tokens 94 and 100 of 200.
        let padding = |r: usize, t: usize| t >= [94, 100][r];
        let zero = |x: &HostTensor| tokens(x, &case, &padding).iter().all(|&b| b == 0);
        assert!(zero(&out.o), "o at padding tokens");
        for (what, x) in [("dq", &g.dq), ("dk", &g.dk), ("dv", &g.dv), ("dg", &g.dg), ("dbeta", &g.dbeta)] {
            assert!(zero(x), "{what} at padding tokens");
        }
    }

    /// The GPU backward (fused, saved state, f32): changing one segment's inputs and `do` (row
    /// 0's second of `packed_rows_differ`, from token 30) leaves every other token's gradients
    /// and every other segment's `dh0` bitwise equal.
    #[test]
    fn the_gpu_backward_isolates_segments() {
        let case = kda_testkit::cases::case("packed_rows_differ").expect("case");
        let inside = |r: usize, t: usize| r == 0 && (30..100).contains(&t);
        let [a, b] = vjp_twice_on(&backend(), &case, &inside, true);
        let outside = |r: usize, t: usize| !inside(r, t);
        assert_eq!(grad_tokens(&a, &case, &outside), grad_tokens(&b, &case, &outside), "gradients outside");
        assert_ne!(grad_tokens(&a, &case, &inside)[0], grad_tokens(&b, &case, &inside)[0]);
        let (x, y) = (a.dh0.as_ref().expect("dh0"), b.dh0.as_ref().expect("dh0"));
        only_slot_changed(x, y, case.b * 3, 1, "dh0");
    }
}

/// On a GPU host only (`cargo xtask gpu-check`): the `triton` row on the CUDA plugin, the
/// covering set of the forward and backward against the reference, and one forward repeated
/// with the same inputs bitwise the same.
mod gpu {
    use kda_core::{BackwardStrategy, DType};
    use kda_testkit::conformance::{backward, forward, Path};
    use kda_tpu::{Implementation, PjrtBackend};
    use rstest::rstest;

    use super::triton_interpret::run;
    use DType::{BF16, F32};

    fn backend() -> PjrtBackend {
        let be = PjrtBackend::new().expect("PJRT plugin (KDA_PJRT_PLUGIN: the CUDA plugin)");
        let platform = be.platform().to_lowercase();
        assert!(
            platform.contains("cuda"),
            "the gpu:: tier runs on a GPU (`cargo xtask gpu-check`), not on {platform}"
        );
        let tuning = be.tuning().with_implementation(Implementation::Triton);
        be.with_tuning(tuning).expect("the triton row")
    }

    #[rstest]
    #[case::fixed_small_f32("fixed_small", F32)]
    #[case::batch_first_b2_bf16("fixed_batch_first_b2", BF16)]
    #[case::k129_v127_f32("k129_v127", F32)]
    #[case::lower_bound_l2norm_bf16("gate_lower_bound_l2norm", BF16)]
    #[case::softplus_f32("gate_softplus", F32)]
    #[case::hard_reset_f32("hard_reset", F32)]
    #[case::packed_lengths_f32("packed_lengths_1_63_64_65_0", F32)]
    #[case::packed_rows_differ_bf16("packed_rows_differ", BF16)]
    fn triton_forward_meets_the_reference(#[case] name: &str, #[case] dtype: DType) {
        run(forward(&backend(), name, dtype));
    }

    #[rstest]
    #[case::fixed_small_saved_split_f32("fixed_small", F32, BackwardStrategy::SavedState, Path::Split)]
    #[case::packed_rows_differ_saved_fused_bf16(
        "packed_rows_differ",
        BF16,
        BackwardStrategy::SavedState,
        Path::Fused
    )]
    fn triton_backward_meets_the_reference(
        #[case] name: &str,
        #[case] dtype: DType,
        #[case] strategy: BackwardStrategy,
        #[case] path: Path,
    ) {
        run(backward(&backend(), name, dtype, strategy, path));
    }

    #[test]
    fn a_repeated_triton_forward_is_bitwise_the_same() {
        let case = kda_testkit::cases::case("packed_rows_differ").expect("case");
        let inputs = kda_testkit::case_data(&case, BF16).expect("inputs").inputs;
        let be = backend();
        let once = || be.forward(&inputs, BackwardStrategy::Rematerialize).expect("forward").0;
        let (a, b) = (once(), once());
        let bits =
            |o: &kda_core::KdaOutputs| o.o.to_f32_vec().iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&a), bits(&b));
    }
}

/// The forward programs through the Mosaic forward kernel's interpret lowering
/// (`Implementation::Interpret`: the kernel libtpu compiles, as plain StableHLO) against the
/// reference at the limits of docs/kda.md, Accuracy: a covering set here (fixed and packed,
/// both layouts, singleton and off-tiling widths, K up to 256, the in-kernel gate and L2 norm,
/// no states, hard resets, every segment empty), every case and dtype in `full::`. The split
/// saved-state backward reads the kernel's per-chunk states.
mod interpret {
    use kda_core::{BackwardStrategy, DType, HostTensor, KdaInputs, KdaOutputs, Layout};
    use kda_testkit::cases::CaseSegments;
    use kda_testkit::conformance::{backward, forward, Path};
    use kda_testkit::{Case, CaseGate};
    use kda_tpu::{Implementation, PjrtBackend};
    use rstest::rstest;
    use BackwardStrategy::{Rematerialize, SavedState};

    use DType::{BF16, F32};
    use Path::{Fused, Split};

    pub fn backend() -> PjrtBackend {
        PjrtBackend::new()
            .and_then(|b| b.clone().with_tuning(b.tuning().with_implementation(Implementation::Interpret)))
            .expect("PJRT plugin (run `cargo xtask setup`)")
    }

    fn run(r: Result<kda_testkit::conformance::Report, String>) {
        match r {
            Ok(report) => eprint!("{report}"),
            Err(failure) => panic!("conformance failure:\n{failure}"),
        }
    }

    #[rstest]
    #[case::fixed_small_f32("fixed_small", F32)]
    #[case::batch_first_b2_bf16("fixed_batch_first_b2", BF16)]
    #[case::singleton_f32("singleton_h1_b1_t1", F32)]
    #[case::k129_v127_f32("k129_v127", F32)]
    #[case::k256_v32_bf16("k256_v32", BF16)]
    #[case::no_states_f32("no_states", F32)]
    #[case::lower_bound_l2norm_bf16("gate_lower_bound_l2norm", BF16)]
    #[case::softplus_f32("gate_softplus", F32)]
    #[case::hard_reset_f32("hard_reset", F32)]
    #[case::packed_lengths_f32("packed_lengths_1_63_64_65_0", F32)]
    #[case::packed_rows_differ_bf16("packed_rows_differ", BF16)]
    #[case::packed_all_empty_f32("packed_all_empty", F32)]
    fn forward_meets_the_reference(#[case] name: &str, #[case] dtype: DType) {
        run(forward(&backend(), name, dtype));
    }

    /// `x` with the tokens `pick(row, token)` taken from `y` (same shape, f32; per-token
    /// tensors and beta in `layout`, any trailing width).
    fn splice(
        x: &HostTensor,
        y: &HostTensor,
        layout: Layout,
        (h, b, t): (usize, usize, usize),
        pick: &dyn Fn(usize, usize) -> bool,
    ) -> HostTensor {
        let (mut out, other) = (x.to_f32_vec(), y.to_f32_vec());
        let d = out.len() / (h * b * t);
        for (i, (o, y)) in out.iter_mut().zip(&other).enumerate() {
            let (row, tok) = match layout {
                Layout::HeadFirst => ((i / (d * t)) % b, (i / d) % t),
                Layout::BatchFirst => (i / (d * h * t), (i / (d * h)) % t),
            };
            if pick(row, tok) {
                *o = *y;
            }
        }
        HostTensor::from_f32(x.shape(), out).expect("same shape")
    }

    /// The case's inputs with the tokens `pick` selects drawn again (another seed's values),
    /// and the forward's outputs of both.
    fn forward_twice(case: Case, pick: &dyn Fn(usize, usize) -> bool) -> (Case, [KdaOutputs; 2]) {
        forward_twice_on(&backend(), case, pick)
    }

    /// [`forward_twice`] on the backend `be`.
    pub fn forward_twice_on(
        be: &PjrtBackend,
        case: Case,
        pick: &dyn Fn(usize, usize) -> bool,
    ) -> (Case, [KdaOutputs; 2]) {
        let a = kda_testkit::case_data(&case, F32).expect("inputs").inputs;
        let other = kda_testkit::case_data(&Case { name: "another_draw", ..case.clone() }, F32)
            .expect("inputs")
            .inputs;
        let mut b = a.clone();
        let dims = (case.h, case.b, case.t);
        let layout = a.config.layout;
        b.q = splice(&a.q, &other.q, layout, dims, pick);
        b.k = splice(&a.k, &other.k, layout, dims, pick);
        b.v = splice(&a.v, &other.v, layout, dims, pick);
        b.g = splice(&a.g, &other.g, layout, dims, pick);
        b.beta = splice(&a.beta, &other.beta, layout, dims, pick);
        let run = |x: &KdaInputs| be.forward(x, BackwardStrategy::Rematerialize).expect("forward").0;
        (case, [run(&a), run(&b)])
    }

    /// `o` at the tokens `pick` selects, in the case's layout.
    pub fn tokens(o: &HostTensor, case: &Case, pick: &dyn Fn(usize, usize) -> bool) -> Vec<u32> {
        let zero = HostTensor::zeros(o.shape(), F32);
        let picked = splice(&zero, o, case.layout, (case.h, case.b, case.t), pick);
        picked.to_f32_vec().iter().map(|x| x.to_bits()).collect()
    }

    /// Packed segments the kernel reads in place (rows of 96 tokens: whole 64-token blocks):
    /// row 0 of segments of 30, 40 and 26 tokens, row 1 of 50, 0 and 46.
    fn packed_in_place(layout: Layout, k: usize, v: usize) -> Case {
        Case {
            layout,
            segments: CaseSegments::Lengths(vec![vec![30, 40, 26], vec![50, 0, 46]]),
            ..Case::base("kernel_packed_in_place", 2, 2, 96, k, v)
        }
    }

    /// Packed segments without per-segment states, which the kernels read as one row of whole
    /// blocks with the boundaries inside a chunk as masks (`Tuning::packed_blocks`): the rows of
    /// [`packed_in_place`], or with trailing padding (row 0 of 30, 40 and 10 tokens, row 1 of
    /// 50, 0 and 30).
    fn packed_blocks(layout: Layout, k: usize, v: usize, padding: bool) -> Case {
        let rows = if padding {
            vec![vec![30, 40, 10], vec![50, 0, 30]]
        } else {
            vec![vec![30, 40, 26], vec![50, 0, 46]]
        };
        Case {
            initial_state: false,
            final_state: false,
            segments: CaseSegments::Lengths(rows),
            ..packed_in_place(layout, k, v)
        }
    }

    /// How the kernels read the packed rows of an isolation test: through lanes
    /// (`packed_rows_differ`, rows of 100 and 140 tokens), in place through windows (with
    /// states), as whole blocks (no states; head-first), as whole blocks with trailing padding
    /// (batch-first).
    #[derive(Debug, Clone, Copy)]
    enum Route {
        Lanes,
        Windows,
        Blocks,
        BlocksPadded,
    }

    impl Route {
        /// The case, and the end of row 0's second segment (the one the tests change).
        fn case(self) -> (Case, usize) {
            match self {
                Route::Lanes => (kda_testkit::cases::case("packed_rows_differ").expect("case"), 100),
                Route::Windows => (packed_in_place(Layout::HeadFirst, 16, 24), 70),
                Route::Blocks => (packed_blocks(Layout::HeadFirst, 16, 24, false), 70),
                Route::BlocksPadded => (packed_blocks(Layout::BatchFirst, 128, 128, true), 70),
            }
        }
    }

    /// Changing the tokens of one segment (row 0's second, tokens `30 .. end`) leaves every
    /// other token's output and every other segment's final state bitwise equal: through lanes
    /// (`packed_rows_differ`), read in place through windows, and read as whole blocks (the
    /// changed segment's boundaries inside chunks; no final states there, and padding tokens'
    /// `o` exactly 0 whatever they hold).
    #[rstest]
    fn the_kernel_forward_isolates_segments(
        #[values(Route::Lanes, Route::Windows, Route::Blocks, Route::BlocksPadded)] route: Route,
    ) {
        let (case, end) = route.case();
        let inside = |r: usize, t: usize| r == 0 && (30..end).contains(&t);
        let (case, [a, b]) = forward_twice(case, &inside);
        let outside = |r: usize, t: usize| !inside(r, t);
        assert_eq!(
            tokens(&a.o, &case, &outside),
            tokens(&b.o, &case, &outside),
            "outputs outside the segment"
        );
        assert_ne!(tokens(&a.o, &case, &inside), tokens(&b.o, &case, &inside));
        match (a.final_state, b.final_state) {
            (Some(fa), Some(fb)) => only_slot_changed(&fa, &fb, case.b * 3, 1, "final state"),
            _ => assert!(padding(&case, &a.o).iter().all(|&x| x.to_bits() == 0), "o at padding tokens"),
        }
    }

    /// `x` and `y` (`[B, N, H, K, V]` states of `slots` slots) differ in slot `changed` and
    /// are bitwise equal in every other.
    pub fn only_slot_changed(x: &HostTensor, y: &HostTensor, slots: usize, changed: usize, what: &str) {
        let (x, y) = (x.to_f32_vec(), y.to_f32_vec());
        let per_slot = x.len() / slots;
        for (slot, (x, y)) in x.chunks(per_slot).zip(y.chunks(per_slot)).enumerate() {
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            if slot == changed {
                assert_ne!(bits(x), bits(y), "the changed segment's {what}");
            } else {
                assert_eq!(bits(x), bits(y), "{what} of slot {slot}");
            }
        }
    }

    /// The fused forward+VJP on the kernels of `case` (f32) with the tokens `pick` selects
    /// of the inputs (`inputs`) or of `do` drawn again: the gradients of both.
    fn vjp_twice(
        case: &Case,
        pick: &dyn Fn(usize, usize) -> bool,
        inputs: bool,
    ) -> [kda_core::KdaGradients; 2] {
        vjp_twice_on(&backend(), case, pick, inputs)
    }

    /// [`vjp_twice`] on the backend `be`.
    pub fn vjp_twice_on(
        be: &PjrtBackend,
        case: &Case,
        pick: &dyn Fn(usize, usize) -> bool,
        inputs: bool,
    ) -> [kda_core::KdaGradients; 2] {
        let a = kda_testkit::case_data(case, F32).expect("inputs");
        let other =
            kda_testkit::case_data(&Case { name: "another_draw", ..case.clone() }, F32).expect("inputs");
        let mut b = a.clone();
        let dims = (case.h, case.b, case.t);
        let layout = a.inputs.config.layout;
        if inputs {
            let (x, y) = (&a.inputs, &other.inputs);
            b.inputs.q = splice(&x.q, &y.q, layout, dims, pick);
            b.inputs.k = splice(&x.k, &y.k, layout, dims, pick);
            b.inputs.v = splice(&x.v, &y.v, layout, dims, pick);
            b.inputs.g = splice(&x.g, &y.g, layout, dims, pick);
            b.inputs.beta = splice(&x.beta, &y.beta, layout, dims, pick);
        }
        b.cotangents.d_o = splice(&a.cotangents.d_o, &other.cotangents.d_o, layout, dims, pick);
        let run = |d: &kda_testkit::CaseData| {
            be.forward_and_vjp(&d.inputs, &d.cotangents, SavedState).expect("forward and vjp").1
        };
        [run(&a), run(&b)]
    }

    /// Each per-token gradient at the tokens `pick` selects, bitwise, in the case's layout.
    pub fn grad_tokens(
        g: &kda_core::KdaGradients,
        case: &Case,
        pick: &dyn Fn(usize, usize) -> bool,
    ) -> Vec<Vec<u32>> {
        [&g.dq, &g.dk, &g.dv, &g.dg, &g.dbeta].iter().map(|x| tokens(x, case, pick)).collect()
    }

    /// The backward kernel is deterministic (two runs agree bitwise) and causal in reverse:
    /// changing `do` at tokens before 70 leaves every gradient from token 70 on bitwise equal
    /// and changes earlier ones.
    #[test]
    fn the_kernel_backward_is_deterministic_and_causal() {
        let case = kda_testkit::cases::case("fixed_batch_first_b2").expect("case");
        let same = vjp_twice(&case, &|_, _| false, false);
        assert_eq!(grad_tokens(&same[0], &case, &|_, _| true), grad_tokens(&same[1], &case, &|_, _| true));
        assert_eq!(same[0].dh0, same[1].dh0);
        let [a, b] = vjp_twice(&case, &|_, t| t < 70, false);
        let late = |_: usize, t: usize| t >= 70;
        assert_eq!(
            grad_tokens(&a, &case, &late),
            grad_tokens(&b, &case, &late),
            "gradients from token 70 on"
        );
        let early = |_: usize, t: usize| t < 70;
        assert_ne!(
            grad_tokens(&a, &case, &early)[0],
            grad_tokens(&b, &case, &early)[0],
            "dq before token 70"
        );
    }

    /// Changing one segment's inputs and `do` (row 0's second, tokens `30 .. end`) leaves every
    /// other token's gradients and every other segment's `dh0` bitwise equal: through lanes,
    /// with the forward reading packed tokens in place through windows, and as whole blocks
    /// (no `dh0` there; padding tokens' gradients exactly 0 whatever they and their `do` hold).
    #[rstest]
    fn the_kernel_backward_isolates_segments(
        #[values(Route::Lanes, Route::Windows, Route::Blocks, Route::BlocksPadded)] route: Route,
    ) {
        let (case, end) = route.case();
        let inside = |r: usize, t: usize| r == 0 && (30..end).contains(&t);
        let [a, b] = vjp_twice(&case, &inside, true);
        let outside = |r: usize, t: usize| !inside(r, t);
        assert_eq!(grad_tokens(&a, &case, &outside), grad_tokens(&b, &case, &outside), "gradients outside");
        assert_ne!(grad_tokens(&a, &case, &inside)[0], grad_tokens(&b, &case, &inside)[0]);
        if let (Some(x), Some(y)) = (&a.dh0, &b.dh0) {
            only_slot_changed(x, y, case.b * 3, 1, "dh0");
            return;
        }
        for (what, x) in [("dq", &a.dq), ("dk", &a.dk), ("dv", &a.dv), ("dg", &a.dg), ("dbeta", &a.dbeta)] {
            assert!(padding(&case, x).iter().all(|&x| x.to_bits() == 0), "{what} at padding tokens");
        }
    }

    /// Fixed-length rows of whole chunks and packed rows of whole 64-token blocks, which the
    /// kernel reads in place (head-first, and batch-first with 128-lane heads) and whose gate
    /// and L2 norm it applies itself.
    #[rstest]
    #[case::head_first_softplus_f32(Case { gate: CaseGate::Softplus, ..Case::base("kernel_in_place_softplus", 2, 2, 128, 16, 24) }, F32)]
    #[case::head_first_lower_bound_l2norm_bf16(Case { gate: CaseGate::LowerBound(-5.0), l2norm: true, ..Case::base("kernel_in_place_lower_bound", 2, 1, 192, 32, 32) }, BF16)]
    #[case::batch_first_lower_bound_l2norm_f32(Case { gate: CaseGate::LowerBound(-5.0), l2norm: true, layout: Layout::BatchFirst, ..Case::base("kernel_in_place_batch_first", 2, 2, 128, 128, 128) }, F32)]
    #[case::batch_first_preactivated_bf16(Case { layout: Layout::BatchFirst, ..Case::base("kernel_in_place_batch_first_pre", 2, 1, 128, 128, 128) }, BF16)]
    #[case::packed_head_first_softplus_f32(Case { gate: CaseGate::Softplus, ..packed_in_place(Layout::HeadFirst, 16, 24) }, F32)]
    #[case::packed_batch_first_lower_bound_l2norm_bf16(Case { gate: CaseGate::LowerBound(-5.0), l2norm: true, ..packed_in_place(Layout::BatchFirst, 128, 128) }, BF16)]
    #[case::blocks_head_first_softplus_f32(Case { gate: CaseGate::Softplus, ..packed_blocks(Layout::HeadFirst, 16, 24, false) }, F32)]
    #[case::blocks_padded_batch_first_lower_bound_l2norm_bf16(Case { gate: CaseGate::LowerBound(-5.0), l2norm: true, ..packed_blocks(Layout::BatchFirst, 128, 128, true) }, BF16)]
    fn in_place_forward_meets_the_reference(#[case] case: Case, #[case] dtype: DType) {
        run(kda_testkit::conformance::forward_case(&backend(), &case, dtype));
    }

    /// The backward kernel on rows of other lengths and packed rows (through lanes), from the
    /// states the forward kernel saved (split saved state: its chunk terms formed again) or
    /// with the chunk terms it saved (fused, and the rematerialized backward).
    #[rstest]
    #[case::fixed_small_saved_split_f32("fixed_small", F32, SavedState, Split)]
    #[case::packed_rows_differ_saved_split_f32("packed_rows_differ", F32, SavedState, Split)]
    #[case::lower_bound_l2norm_saved_split_bf16("gate_lower_bound_l2norm", BF16, SavedState, Split)]
    #[case::fixed_small_remat_fused_bf16("fixed_small", BF16, Rematerialize, Fused)]
    #[case::k129_v127_saved_fused_f32("k129_v127", F32, SavedState, Fused)]
    #[case::singleton_saved_fused_f32("singleton_h1_b1_t1", F32, SavedState, Fused)]
    #[case::packed_lengths_remat_split_f32("packed_lengths_1_63_64_65_0", F32, Rematerialize, Split)]
    fn backward_meets_the_reference(
        #[case] name: &str,
        #[case] dtype: DType,
        #[case] strategy: BackwardStrategy,
        #[case] path: Path,
    ) {
        run(backward(&backend(), name, dtype, strategy, path));
    }

    /// The backward kernel reading the caller's tensors in place (the cases of
    /// `in_place_forward_meets_the_reference`): its gate, gate-parameter sums, L2 norm,
    /// batch-first beta, and packed tokens read through windows with every gradient written
    /// straight to its packed token.
    #[rstest]
    #[case::head_first_softplus_f32(Case { gate: CaseGate::Softplus, ..Case::base("kernel_in_place_softplus", 2, 2, 128, 16, 24) }, F32, SavedState, Split)]
    #[case::head_first_lower_bound_l2norm_bf16(Case { gate: CaseGate::LowerBound(-5.0), l2norm: true, ..Case::base("kernel_in_place_lower_bound", 2, 1, 192, 32, 32) }, BF16, SavedState, Fused)]
    #[case::batch_first_lower_bound_l2norm_f32(Case { gate: CaseGate::LowerBound(-5.0), l2norm: true, layout: Layout::BatchFirst, ..Case::base("kernel_in_place_batch_first", 2, 2, 128, 128, 128) }, F32, Rematerialize, Fused)]
    #[case::packed_head_first_softplus_f32(Case { gate: CaseGate::Softplus, ..packed_in_place(Layout::HeadFirst, 16, 24) }, F32, SavedState, Fused)]
    #[case::packed_batch_first_lower_bound_l2norm_bf16(Case { gate: CaseGate::LowerBound(-5.0), l2norm: true, ..packed_in_place(Layout::BatchFirst, 128, 128) }, BF16, Rematerialize, Split)]
    #[case::blocks_padded_head_first_softplus_f32(Case { gate: CaseGate::Softplus, ..packed_blocks(Layout::HeadFirst, 16, 24, true) }, F32, SavedState, Split)]
    #[case::blocks_head_first_preactivated_f32(
        packed_blocks(Layout::HeadFirst, 16, 24, false),
        F32,
        SavedState,
        Fused
    )]
    #[case::blocks_batch_first_lower_bound_l2norm_bf16(Case { gate: CaseGate::LowerBound(-5.0), l2norm: true, ..packed_blocks(Layout::BatchFirst, 128, 128, false) }, BF16, Rematerialize, Fused)]
    #[case::blocks_padded_batch_first_lower_bound_l2norm_f32(Case { gate: CaseGate::LowerBound(-5.0), l2norm: true, ..packed_blocks(Layout::BatchFirst, 128, 128, true) }, F32, Rematerialize, Split)]
    fn in_place_backward_meets_the_reference(
        #[case] case: Case,
        #[case] dtype: DType,
        #[case] strategy: BackwardStrategy,
        #[case] path: Path,
    ) {
        run(kda_testkit::conformance::backward_case(&backend(), &case, dtype, strategy, path));
    }

    /// Gradient compaction: the kernels reading packed tokens in place and writing every
    /// result straight to its packed token agree with the gather path (the same kernels on
    /// chunk-aligned lanes that XLA gathers and compacts back, `packed_result_bytes` 0)
    /// within docs/kda.md's limits: 1e-7 absolute in f32, equal in bf16; padding tokens 0 on
    /// both. The in-kernel gate is the one difference of arithmetic between the paths (lanes
    /// get the gate XLA activated), so with it f32 agrees within 4 ULPs of each tensor's
    /// largest magnitude instead.
    #[rstest]
    #[case::head_first_f32(padded(Layout::HeadFirst, 16, 24), F32, SavedState)]
    #[case::head_first_bf16(padded(Layout::HeadFirst, 16, 24), BF16, Rematerialize)]
    #[case::batch_first_bf16(padded(Layout::BatchFirst, 128, 128), BF16, SavedState)]
    #[case::batch_first_lower_bound_l2norm_f32(Case { gate: CaseGate::LowerBound(-5.0), l2norm: true, ..padded(Layout::BatchFirst, 128, 128) }, F32, Rematerialize)]
    fn compaction_agrees_with_the_gather_path(
        #[case] case: Case,
        #[case] dtype: DType,
        #[case] strategy: BackwardStrategy,
    ) {
        let data = kda_testkit::case_data(&case, dtype).expect("inputs");
        let run = |be: PjrtBackend| {
            be.forward_and_vjp(&data.inputs, &data.cotangents, strategy).expect("forward and vjp")
        };
        let gather = backend().with_tuning(backend().tuning().with_packed_result_bytes(0)).expect("a tuning");
        let ((o, g), (gather_o, gather_g)) = (run(backend()), run(gather));
        // Every output and gradient but the gate parameters' (summed through different
        // arithmetic on the two paths).
        let pairs = super::paired((&o, &g), (&gather_o, &gather_g));
        for (what, x, y) in pairs.into_iter().filter(|(n, ..)| !matches!(*n, "da_log" | "ddt_bias")) {
            let (x, y) = (x.expect(what).to_f32_vec(), y.expect(what).to_f32_vec());
            let largest = y.iter().fold(0f32, |m, v| m.max(v.abs()));
            let worst = x.iter().zip(&y).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            let limit = match (dtype, case.gate) {
                (BF16, _) => 0.0,
                (_, CaseGate::Preactivated) => 1e-7,
                _ => 4.0 * f32::EPSILON * largest,
            };
            eprintln!(
                "{what}: at most {worst:.2e} from the gather path (largest {largest:.3e}, limit {limit:.2e})"
            );
            assert!(worst <= limit, "{what}: {worst:.3e} from the gather path, limit {limit:.3e}");
        }
        for (what, x) in [("o", &o.o), ("dq", &g.dq), ("dv", &g.dv), ("dg", &g.dg), ("dbeta", &g.dbeta)] {
            let pad = padding(&case, x);
            assert!(!pad.is_empty() && pad.iter().all(|&x| x.to_bits() == 0), "{what} at padding tokens");
        }
    }

    /// Packed rows of 96 tokens read in place with trailing padding: row 0 of segments of 30,
    /// 40 and 10 tokens, row 1 of 50, 0 and 30.
    fn padded(layout: Layout, k: usize, v: usize) -> Case {
        Case {
            segments: CaseSegments::Lengths(vec![vec![30, 40, 10], vec![50, 0, 30]]),
            ..packed_in_place(layout, k, v)
        }
    }

    /// The values of `x` at the padding tokens of `case`'s rows.
    fn padding(case: &Case, x: &HostTensor) -> Vec<f32> {
        let CaseSegments::Lengths(rows) = &case.segments else { return Vec::new() };
        let ends: Vec<usize> = rows.iter().map(|r| r.iter().sum()).collect();
        let dims = (case.h, case.b, case.t);
        let ones = HostTensor::from_f32(x.shape(), vec![1.0; x.len()]).expect("ones");
        let zero = HostTensor::zeros(x.shape(), F32);
        let mask = splice(&zero, &ones, case.layout, dims, &|r, t| t >= ends[r]).to_f32_vec();
        let values = x.to_f32_vec();
        values.into_iter().zip(mask).filter(|&(_, m)| m != 0.0).map(|(v, _)| v).collect()
    }

    /// Fixed-length rows read in place run several chunks per grid step (four by default at
    /// these sizes, 0 below; sixteen when the inputs stream from HBM, under `full::`): the
    /// per-chunk states, initial and final states, `o` and every gradient of every chunk of a
    /// step.
    #[rstest]
    #[case::two_head_first_f32(Layout::HeadFirst, F32, 256, 2)]
    #[case::four_batch_first_bf16(Layout::BatchFirst, BF16, 256, 0)]
    pub fn chunks_per_step_keep_every_state(
        #[case] layout: Layout,
        #[case] dtype: DType,
        #[case] t: usize,
        #[case] step_chunks: usize,
    ) {
        let case = Case { layout, ..Case::base("kernel_chunks_per_step", 2, 2, t, 128, 128) };
        run(kda_testkit::conformance::backward_case(
            &backend().with_tuning(backend().tuning().with_step_chunks(step_chunks)).expect("a tuning"),
            &case,
            dtype,
            BackwardStrategy::SavedState,
            Path::Split,
        ));
    }
}

/// The whole product of the parallel factors (`cargo xtask test --full`): devices x case x
/// strategy x path x dtype, for data and for context parallelism (the pieces on XLA's programs
/// and on the kernels); the interpret lowering of the kernels on every case of the table.
mod full {
    /// Sixteen chunks per grid step of fixed-length rows read in place (the inputs streamed
    /// from HBM): every state and gradient of every chunk of a step.
    #[test]
    fn interpret_sixteen_chunks_per_step_keep_every_state() {
        super::interpret::chunks_per_step_keep_every_state(
            kda_core::Layout::BatchFirst,
            kda_core::DType::BF16,
            1024,
            16,
        );
    }

    use kda_core::{BackwardStrategy, DType};
    use kda_testkit::conformance::{backward_case, Path};
    use kda_tpu::PjrtOptions;
    use rstest::rstest;

    #[rstest]
    fn context_parallel_product(
        #[values(kda_tpu::Implementation::Xla, kda_tpu::Implementation::Interpret)]
        implementation: kda_tpu::Implementation,
        #[values(2, 3, 4)] devices: usize,
        #[values(
            "l2norm_preactivated",
            "span_200",
            "mixed_rows",
            "short_row",
            "k_ne_v_200",
            "gate_softplus",
            "packed_segment_ids"
        )]
        name: &str,
        #[values(BackwardStrategy::SavedState, BackwardStrategy::Rematerialize)] strategy: BackwardStrategy,
        #[values(Path::Fused, Path::Split)] path: Path,
        #[values(DType::F32, DType::BF16)] dtype: DType,
    ) {
        let be = super::context_parallel::backend(devices);
        let be =
            be.clone().with_tuning(be.tuning().with_implementation(implementation)).expect("implementation");
        if let Err(failure) = backward_case(&be, &super::context_parallel::named(name), dtype, strategy, path)
        {
            panic!("conformance failure on {devices} devices:\n{failure}");
        }
    }

    #[rstest]
    fn data_parallel_product(
        #[values(2, 3, 4)] devices: usize,
        #[values(
            "fixed_batch_first_b2",
            "packed_rows_differ",
            "packed_segment_ids",
            "softplus_b3",
            "packed_rows_b5",
            "beta_trailing_one"
        )]
        name: &str,
        #[values(BackwardStrategy::SavedState, BackwardStrategy::Rematerialize)] strategy: BackwardStrategy,
        #[values(Path::Fused, Path::Split)] path: Path,
        #[values(DType::F32, DType::BF16)] dtype: DType,
    ) {
        let be = PjrtOptions::new().devices(devices).build().expect("PJRT plugin (run `cargo xtask setup`)");
        if let Err(failure) = backward_case(&be, &super::data_parallel::named(name), dtype, strategy, path) {
            panic!("conformance failure on {devices} devices:\n{failure}");
        }
    }

    /// The interpret lowering of the backward kernels on every case of the table: both
    /// strategies, split and fused.
    #[rstest]
    fn interpret_backward_every_case(
        #[values(BackwardStrategy::SavedState, BackwardStrategy::Rematerialize)] strategy: BackwardStrategy,
        #[values(Path::Fused, Path::Split)] path: Path,
        #[values(DType::F32, DType::BF16)] dtype: DType,
    ) {
        let be = super::interpret::backend();
        every_case(|name| kda_testkit::conformance::backward(&be, name, dtype, strategy, path).err());
    }

    /// `check` on every case of the table (its failure, if any), all failures reported at once.
    fn every_case(check: impl Fn(&str) -> Option<String>) {
        let failures: Vec<String> = kda_testkit::CASE_NAMES.iter().filter_map(|name| check(name)).collect();
        assert!(failures.is_empty(), "{} cases failed:\n{}", failures.len(), failures.join("\n"));
    }

    /// Bitwise causality on every configuration: implementations, devices (one, or two with
    /// `Split::Context`), rows, dtypes, strategies and paths.
    #[rstest]
    fn causality_product(
        #[values(kda_tpu::Implementation::Xla, kda_tpu::Implementation::Interpret)]
        implementation: kda_tpu::Implementation,
        #[values(1, 2)] devices: usize,
        #[values(
            (crate::causality::Place::InPlace, kda_testkit::causality::Rows::Fixed),
            (crate::causality::Place::InPlace, kda_testkit::causality::Rows::Packed),
            (crate::causality::Place::InPlace, kda_testkit::causality::Rows::PackedNoStates),
            (crate::causality::Place::Lanes, kda_testkit::causality::Rows::Packed)
        )]
        rows: (crate::causality::Place, kda_testkit::causality::Rows),
        #[values(DType::F32, DType::BF16)] dtype: DType,
        #[values(BackwardStrategy::SavedState, BackwardStrategy::Rematerialize)] strategy: BackwardStrategy,
        #[values(Path::Fused, Path::Split)] path: Path,
    ) {
        let setup = kda_testkit::causality::Setup { rows: rows.1, dtype, strategy, path };
        super::causality::holds(implementation, devices, rows.0, setup);
    }

    /// The interpret lowering on every packed case of the table without per-segment states
    /// (those whose tokens fill whole 64-token blocks the kernels read as whole blocks with
    /// segment masks, the rest through lanes): both strategies, split and fused, f32 and bf16.
    #[rstest]
    fn interpret_packed_cases_without_states(
        #[values(BackwardStrategy::SavedState, BackwardStrategy::Rematerialize)] strategy: BackwardStrategy,
        #[values(Path::Fused, Path::Split)] path: Path,
        #[values(DType::F32, DType::BF16)] dtype: DType,
    ) {
        use kda_testkit::cases::CaseSegments;
        let be = super::interpret::backend();
        let failures: Vec<String> = kda_testkit::cases::all_cases()
            .into_iter()
            .filter(|c| !matches!(c.segments, CaseSegments::Fixed))
            .map(|c| kda_testkit::Case { initial_state: false, final_state: false, ..c })
            .filter_map(|c| backward_case(&be, &c, dtype, strategy, path).err())
            .collect();
        assert!(failures.is_empty(), "{} cases failed:\n{}", failures.len(), failures.join("\n"));
    }

    /// Packed rows read in place: pre-activated (split saved state) and softplus (fused) in f32
    /// against the reference.
    #[rstest]
    #[case::preactivated_saved_split_f32(
        crate::triton_interpret::packed_in_place("packed_in_place"),
        DType::F32,
        BackwardStrategy::SavedState,
        Path::Split
    )]
    #[case::softplus_saved_fused_f32(kda_testkit::Case { gate: kda_testkit::CaseGate::Softplus, ..crate::triton_interpret::packed_in_place("packed_in_place_softplus") }, DType::F32, BackwardStrategy::SavedState, Path::Fused)]
    fn triton_interpret_packed_rows_in_place(
        #[case] case: kda_testkit::Case,
        #[case] dtype: DType,
        #[case] strategy: BackwardStrategy,
        #[case] path: Path,
    ) {
        super::triton_interpret::packed_in_place_meets_the_reference(&case, dtype, strategy, path);
    }

    /// Head-first packed rows read in place match the gather path bitwise.
    #[test]
    fn triton_interpret_head_first_packed_rows_match_the_gather_path() {
        super::triton_interpret::packed_in_place_matches_the_gather_path(kda_core::Layout::HeadFirst);
    }

    /// The GPU rows' backward on padded widths (K = 129, V = 127) and hard resets, both
    /// rematerializing (the forward kernels run again).
    #[rstest]
    #[case::k129_v127_remat_split_f32("k129_v127", DType::F32)]
    #[case::hard_reset_remat_split_bf16("hard_reset", DType::BF16)]
    fn triton_interpret_backward(#[case] name: &str, #[case] dtype: DType) {
        let be = super::triton_interpret::backend();
        let r = kda_testkit::conformance::backward(
            &be,
            name,
            dtype,
            BackwardStrategy::Rematerialize,
            Path::Split,
        );
        super::triton_interpret::run(r);
    }

    /// The GPU rows' gate gradients under strong decay (`dg` row by row; `da_log` and
    /// `ddt_bias` on the packed rows with the in-kernel gate).
    #[rstest]
    #[case::rows_saved_split("strong_decay_rows", BackwardStrategy::SavedState, Path::Split)]
    #[case::packed_edges_lower_bound_remat_fused(
        "strong_decay_packed_edges_lower_bound_l2norm",
        BackwardStrategy::Rematerialize,
        Path::Fused
    )]
    fn triton_interpret_gate_gradients(
        #[case] name: &str,
        #[case] strategy: BackwardStrategy,
        #[case] path: Path,
    ) {
        let be = super::triton_interpret::backend();
        match kda_testkit::conformance::gate_gradients(&be, name, strategy, path) {
            Ok(report) => eprint!("{report}"),
            Err(failure) => panic!("gate gradient failure:\n{failure}"),
        }
    }

    /// Causality of the GPU rows on packed rows, both strategies (the rematerializing backward
    /// runs the forward kernels again).
    #[rstest]
    fn triton_interpret_packed_rows_are_causal(
        #[values(BackwardStrategy::SavedState, BackwardStrategy::Rematerialize)] strategy: BackwardStrategy,
    ) {
        use kda_testkit::causality::{Rows, Setup};
        let setup = Setup { rows: Rows::Packed, dtype: DType::BF16, strategy, path: Path::Split };
        let place = super::causality::Place::InPlace;
        super::causality::holds(kda_tpu::Implementation::TritonInterpret, 1, place, setup);
    }

    /// The GPU kernels' interpret lowering on every case of the table, forward and backward.
    #[rstest]
    fn triton_interpret_every_case(
        #[values(BackwardStrategy::SavedState, BackwardStrategy::Rematerialize)] strategy: BackwardStrategy,
        #[values(Path::Fused, Path::Split)] path: Path,
        #[values(DType::F32, DType::BF16)] dtype: DType,
    ) {
        let be = super::triton_interpret::backend();
        every_case(|name| {
            let forward = kda_testkit::conformance::forward(&be, name, dtype).err();
            forward.or_else(|| kda_testkit::conformance::backward(&be, name, dtype, strategy, path).err())
        });
    }

    #[rstest]
    fn interpret_forward_every_case(#[values(DType::F32, DType::BF16)] dtype: DType) {
        let be = super::interpret::backend();
        every_case(|name| kda_testkit::conformance::forward(&be, name, dtype).err());
    }
}

/// Bitwise causality (docs/kda.md, Causality) on every implementation (a covering set; the
/// whole product in `full::causality_product`): for every `t0` in
/// 0..128 and 129, 189, 253, one batch row each, the outputs and gradients before `t0` do not
/// change with the inputs from `t0` on (nor `dh0`), and the gradients from `t0` on do not
/// change with `do` before `t0` ([`kda_testkit::causality`]). Gates in [-6, 0] with three hard
/// resets in a row inside one 4-token block; packed rows with segment boundaries inside 4-token
/// blocks, read in place by the kernels (through windows with initial states, as whole blocks
/// without), or through lanes (`packed_result_bytes` 0).
mod causality {
    use kda_core::{BackwardStrategy, DType};
    use kda_testkit::causality::{Rows, Setup};
    use kda_testkit::conformance::Path;
    use kda_tpu::{Implementation, PjrtBackend, PjrtOptions, Split};
    use rstest::rstest;

    use BackwardStrategy::{Rematerialize as Remat, SavedState as Saved};
    use DType::{BF16, F32};
    use Path::{Fused, Split as Staged};
    use Rows::{Fixed, Packed, PackedNoStates};

    /// Where packed rows go on the kernels: read in place, or through lanes.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub(crate) enum Place {
        InPlace,
        Lanes,
    }

    fn backend(implementation: Implementation, devices: usize, place: Place) -> PjrtBackend {
        let mut o = PjrtOptions::new().tuning(kda_tpu::Tuning::default().with_implementation(implementation));
        if devices > 1 {
            o = o.devices(devices).split(Split::Context);
        }
        let be = o.build().expect("PJRT plugin (run `cargo xtask setup`)");
        match place {
            Place::InPlace => be,
            Place::Lanes => {
                be.clone().with_tuning(be.tuning().with_packed_result_bytes(0)).expect("a tuning")
            }
        }
    }

    /// Causality on `implementation` over `devices` devices (two: `Split::Context`), packed
    /// rows placed as `place` says.
    pub(crate) fn holds(implementation: Implementation, devices: usize, place: Place, setup: Setup) {
        let be = backend(implementation, devices, place);
        match kda_testkit::causality::check(&be, setup) {
            Ok(summary) => eprintln!("{summary}"),
            Err(failure) => panic!("{failure}"),
        }
    }

    #[rstest]
    #[case::fixed_f32_saved_fused(Fixed, F32, Saved, Fused)]
    #[case::packed_bf16_remat_split(Packed, BF16, Remat, Staged)]
    fn xla(#[case] rows: Rows, #[case] dtype: DType, #[case] strategy: BackwardStrategy, #[case] path: Path) {
        holds(Implementation::Xla, 1, Place::InPlace, Setup { rows, dtype, strategy, path });
    }

    /// Each pair of values of any two of rows, dtype, strategy and path once.
    #[rstest]
    #[case::fixed_f32_saved_fused(Place::InPlace, Fixed, F32, Saved, Fused)]
    #[case::fixed_bf16_remat_split(Place::InPlace, Fixed, BF16, Remat, Staged)]
    #[case::in_place_bf16_saved_fused(Place::InPlace, Packed, BF16, Saved, Fused)]
    #[case::in_place_f32_remat_split(Place::InPlace, Packed, F32, Remat, Staged)]
    #[case::lanes_f32_remat_fused(Place::Lanes, Packed, F32, Remat, Fused)]
    #[case::lanes_bf16_saved_split(Place::Lanes, Packed, BF16, Saved, Staged)]
    #[case::blocks_bf16_saved_split(Place::InPlace, PackedNoStates, BF16, Saved, Staged)]
    #[case::blocks_f32_remat_fused(Place::InPlace, PackedNoStates, F32, Remat, Fused)]
    fn interpret(
        #[case] place: Place,
        #[case] rows: Rows,
        #[case] dtype: DType,
        #[case] strategy: BackwardStrategy,
        #[case] path: Path,
    ) {
        holds(Implementation::Interpret, 1, place, Setup { rows, dtype, strategy, path });
    }

    /// The GPU kernels through their interpret lowering (the backward's state gradient among
    /// them): fixed rows (in place, batch-first); packed rows under `full::`.
    #[rstest]
    #[case::fixed_f32_saved_fused(Fixed, F32, Saved, Fused)]
    fn triton_interpret(
        #[case] rows: Rows,
        #[case] dtype: DType,
        #[case] strategy: BackwardStrategy,
        #[case] path: Path,
    ) {
        holds(Implementation::TritonInterpret, 1, Place::InPlace, Setup { rows, dtype, strategy, path });
    }

    /// Two devices, each row cut into two pieces at token 128 (`Split::Context`).
    #[rstest]
    #[case::xla_fixed_bf16_remat(Implementation::Xla, Fixed, BF16, Remat)]
    #[case::interpret_packed_f32_saved(Implementation::Interpret, Packed, F32, Saved)]
    fn context_parallel(
        #[case] implementation: Implementation,
        #[case] rows: Rows,
        #[case] dtype: DType,
        #[case] strategy: BackwardStrategy,
    ) {
        holds(implementation, 2, Place::InPlace, Setup { rows, dtype, strategy, path: Fused });
    }
}
