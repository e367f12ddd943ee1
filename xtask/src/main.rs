//! `cargo xtask ...`: the workspace's commands.
//!
//! Commands that need the PJRT backend (whose `pjrt-sys` build needs the header that `setup`
//! installs) re-run this binary through cargo with the `pjrt` feature and that environment.

// These parse their flags in every build; their measuring and reporting parts are used by
// `pjrt_cmds` only (built with the `pjrt` feature), while their unit tests run in every build.
#[cfg_attr(not(feature = "pjrt"), allow(dead_code))]
mod aot_cmd;
#[cfg_attr(not(feature = "pjrt"), allow(dead_code))]
mod bench;
mod cargo_cmd;
#[cfg_attr(not(feature = "pjrt"), allow(dead_code))]
mod charts;
mod cli;
mod commands;
#[cfg_attr(not(feature = "pjrt"), allow(dead_code))]
mod demo;
mod gpu_bench;
mod gpu_check;
#[cfg(test)]
mod house;
#[cfg(test)]
mod imports;
#[cfg_attr(not(feature = "pjrt"), allow(dead_code))]
mod machine;
mod npy;
#[cfg(feature = "pjrt")]
mod pjrt_cmds;
#[cfg_attr(not(feature = "pjrt"), allow(dead_code))]
mod progress;
#[cfg_attr(not(feature = "pjrt"), allow(dead_code))]
mod results;
mod run_cmd;
mod setup;
mod test_cmd;
mod tpu_test;

const USAGE: &str = "usage: cargo xtask <command> [args]

commands:
  setup               install what the workspace needs (Debian packages, PJRT header, plugins)
  env                 print `export` lines for plain cargo: eval \"$(cargo xtask env)\"
  test [NAME ...] [--full] [--shard i/n] [--clean-cache]
                      run the test suite (see `cargo xtask test --help`): the default tier,
                      or with --full the sweep's whole product too; ends with a summary
  ci                  fmt check, clippy -D warnings, then test
  tpu-test [--plugin PATH] [--full] [--shard i/n]
                      kda-tpu's conformance suite on a PJRT plugin (default: setup's CPU plugin)
  gpu-check [--dir DIR]
                      stage the gpu:: tier's test binaries, a gpu-bench binary, fla's wheel
                      and run.sh for a GPU host without cargo (see `cargo xtask gpu-check --help`)
  gpu-bench [--shape LIST] [--implementation LIST] [--dtype ..] [--iterations N]
                      time the forward programs on the default plugin (the CUDA plugin on a
                      GPU host; see `cargo xtask gpu-bench --help`)
  run --backend ref|pjrt --inputs DIR --out DIR [...]
                      run a backend on .npy tensors (see `cargo xtask run --help`)
  demo [--ref-only]   forward+VJP at the primary benchmark shape: the f64 reference, then the
                      PJRT backend checked against it
  bench --suite forward|backward|backward-packed|all [--iterations N] [--dtype f32|bf16|both]
        [--baseline|--no-baseline] [--no-aot] [--json PATH] [--markdown PATH|--no-markdown]
                      time the programs on the CPU plugin, with CPU and tpu7x:2x2x1 compiler
                      memory figures (see `cargo xtask bench --help`)
  aot [--topology T] [--program P|all] [--shape S|all] [--dtype f32|bf16|both]
                      deviceless TPU compiles: memory statistics and cost analysis
                      (see `cargo xtask aot --help`)

demo, bench, aot and run --backend pjrt build and run xtask with its `pjrt` feature (through
cargo, in setup's environment; the first time takes a few minutes).";

fn dispatch(cmd: &str, rest: &[String]) -> Result<(), String> {
    match cmd {
        "setup" => setup::ensure(true).map(|p| eprintln!("setup: ready in {}", p.home.display())),
        "env" => setup::ensure(false).map(|p| print!("{}", setup::env_lines(&p))),
        "test" => test_cmd::test(rest),
        "ci" => test_cmd::ci(rest),
        "tpu-test" => tpu_test::tpu_test(rest),
        "gpu-check" => gpu_check::gpu_check(rest),
        "gpu-bench" => commands::gpu_bench(rest),
        "run" => run_cmd::run(rest),
        "demo" => commands::demo(rest),
        "bench" => commands::bench(rest),
        "aot" => commands::aot(rest),
        "-h" | "--help" | "help" => {
            println!("{USAGE}");
            Ok(())
        }
        other => Err(format!("unknown command `{other}`\n\n{USAGE}")),
    }
}

/// Sends the libraries' `tracing` output to stderr, filtered by `RUST_LOG` (for example
/// `RUST_LOG=kda_tpu=info` shows every KDA call with its program, shape, dtype and cache hit,
/// and the compile, transfer and execute spans inside it); warnings only by default.
fn install_subscriber() {
    use tracing_subscriber::fmt::format::FmtSpan;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_span_events(FmtSpan::CLOSE)
        .try_init();
}

fn main() {
    // libtpu (aot, bench) otherwise retries a cloud metadata server for about 90 s off GCP. Set
    // here, in the binary, before any thread exists; the library never changes the environment.
    if std::env::var_os("TPU_SKIP_MDS_QUERY").is_none() {
        // SAFETY: the process has one thread at this point, so nothing reads the environment
        // concurrently.
        unsafe { std::env::set_var("TPU_SKIP_MDS_QUERY", "1") };
    }
    install_subscriber();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some((cmd, rest)) = args.split_first() else {
        eprintln!("{USAGE}");
        std::process::exit(2);
    };
    if let Err(e) = dispatch(cmd, rest) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
