//! The conformance suite instantiated for the reference itself at f32/bf16 precision: checks the
//! suite's plumbing (inputs, rounding, metrics, padding checks) end to end. `mutants.rs` shows
//! that the suite catches wrong backends.

kda_testkit::conformance_suite!(kda_ref::RefBackend);
