//! The test kit every backend shares: agreement metrics against the f64 reference
//! (docs/kda.md, Accuracy), the tolerance table, seeded input profiles, the named case table (docs/kda.md, Shapes
//! and the benchmark shapes) and a conformance suite a backend instantiates with one macro:
//!
//! ```text
//! kda_testkit::conformance_suite!(my_backend::MyBackend::new());
//! ```

#![warn(missing_docs)]
#![forbid(unsafe_code)]

pub mod cases;
pub mod causality;
pub mod conformance;
pub mod inputs;
pub mod metrics;
pub mod reference;
pub mod rng;
pub mod sweep;
pub mod tolerance;

pub use cases::{all_cases, benchmark_cases, case, Case, CaseGate, CaseSegments, Profile, CASE_NAMES};
pub use inputs::{case_data, widen, CaseData};
pub use metrics::{agreement, ulp_distance, Agreement};
pub use rng::Rng;
pub use tolerance::{rms_limit, Quantity};

/// Instantiates the whole conformance suite (forward and backward, both strategies, split and
/// fused, f32 and bf16, every case of the table) for the backend that `$make` builds. Invoke it
/// once, at the top level of an integration test file (or of a module). `conformance_suite!([a,
/// b] $make)` instantiates it for the named cases of the table only.
#[macro_export]
macro_rules! conformance_suite {
    ([$($n:ident),* $(,)?] $make:expr) => {
        $crate::for_each_case!(@apply [conformance $make] $($n),*);
    };
    ($make:expr) => {
        $crate::for_each_case!(@list conformance $make);
    };
}

#[doc(hidden)]
pub mod __private {
    pub use crate::cases::Profile;
    pub use crate::conformance::Path;
    pub use crate::sweep::{SweepGate, SweepShape, SweepVariant};
    pub use kda_core::{BackwardStrategy, DType};
}
