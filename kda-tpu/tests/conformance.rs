//! The testkit's full conformance suite on the PJRT backend (the CPU plugin unless
//! `KDA_PJRT_PLUGIN` names another).

kda_testkit::conformance_suite!(kda_tpu::PjrtBackend::new().expect("PJRT plugin (run `cargo xtask setup`)"));

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
        use kda_core::{Backend, BackwardStrategy, GateMode};
        let be = kda_tpu::PjrtBackend::new().expect("PJRT plugin (run `cargo xtask setup`)");
        let case = kda_testkit::cases::case("gate_softplus").expect("case");
        let mut data = kda_testkit::inputs::case_data(&case, DType::F32).expect("inputs");
        let Some((Some(a_log), Some(dt_bias))) = data.inputs.gate.params() else {
            panic!("gate_softplus has a_log and dt_bias")
        };
        let gate = GateMode::softplus(a_log.clone(), Some(dt_bias.cast(DType::BF16)));
        data.inputs.gate = gate;
        let (_, grads) = be
            .forward_and_vjp(&data.inputs, &data.cotangents, BackwardStrategy::SavedState)
            .expect("fused forward+VJP");
        assert_eq!(grads.da_log.as_ref().map(|t| t.dtype()), Some(DType::F32));
        assert_eq!(grads.ddt_bias.as_ref().map(|t| t.dtype()), Some(DType::BF16));
    }
}
