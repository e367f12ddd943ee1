//! The testkit's full conformance suite on the PJRT backend (the CPU plugin unless
//! `KDA_PJRT_PLUGIN` names another).

kda_testkit::conformance_suite!(kda_tpu::PjrtBackend::new().expect("PJRT plugin (run `cargo xtask setup`)"));
