//! `cargo xtask ...`: the workspace's commands.
//!
//! Commands that need the PJRT backend (whose `pjrt-sys` build needs the header that `setup`
//! installs) re-run this binary through cargo with the `pjrt` feature and that environment.

mod cargo_cmd;
mod demo;
mod npy;
mod run_cmd;
mod setup;
mod test_cmd;

const USAGE: &str = "usage: cargo xtask <command> [args]

commands:
  setup               install what the workspace needs (Debian packages, PJRT header, plugins)
  env                 print `export` lines for plain cargo: eval \"$(cargo xtask env)\"
  test [--shard i/n]  run the whole test suite (or one of n shards; needs cargo-nextest)
  ci                  fmt check, clippy -D warnings, then test
  run --backend ref --inputs DIR --out DIR [...]
                      run a backend on .npy tensors (see `cargo xtask run --help`)
  demo                forward+VJP at the primary benchmark shape, checked against the reference";

fn dispatch(cmd: &str, rest: &[String]) -> Result<(), String> {
    match cmd {
        "setup" => setup::ensure(true).map(|p| eprintln!("setup: ready in {}", p.home.display())),
        "env" => setup::ensure(false).map(|p| print!("{}", setup::env_lines(&p))),
        "test" => test_cmd::test(rest),
        "ci" => test_cmd::ci(rest),
        "run" => run_cmd::run(rest),
        "demo" => demo::demo_ref(),
        "-h" | "--help" | "help" => {
            println!("{USAGE}");
            Ok(())
        }
        other => Err(format!("unknown command `{other}`\n\n{USAGE}")),
    }
}

fn main() {
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
