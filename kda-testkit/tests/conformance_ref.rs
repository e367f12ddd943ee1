//! The conformance suite instantiated for the reference itself at f32/bf16 precision: checks the
//! suite's plumbing (input rounding, the shared reference results, metrics, dtype and padding
//! checks) end to end on cases that exercise each part of it: a single token, `beta [.., 1]`, no
//! states, an in-kernel gate with its parameter gradients, packed batch-first rows with padding
//! and empty segments, and segment ids. `mutants.rs` shows that the suite catches wrong backends.
//! `full::` holds every case of the table (`cargo xtask test --full`).

kda_testkit::conformance_suite!(
    [
        singleton_h1_b1_t1,
        beta_trailing_one,
        no_states,
        gate_softplus,
        packed_rows_differ,
        packed_segment_ids
    ]
    kda_ref::RefBackend
);

mod full {
    kda_testkit::conformance_suite!(kda_ref::RefBackend);
}
