//! The entry points of the commands that need the PJRT backend (`aot`, `bench`, `demo`):
//! each parses its flags with its own module, then runs its `pjrt_cmds` part (built with the
//! `pjrt` feature) or re-runs this binary through cargo with that feature.

/// The entry point of `cargo xtask aot`; `args` are the arguments after `aot`.
pub fn aot(args: &[String]) -> Result<(), String> {
    let Some(opts) = crate::aot_cmd::parse_args(args)
        .map_err(|e| format!("xtask aot: {e}\n\n{}", crate::aot_cmd::USAGE))?
    else {
        println!("{}", crate::aot_cmd::USAGE);
        return Ok(());
    };
    #[cfg(feature = "pjrt")]
    {
        crate::pjrt_cmds::aot::run(&opts)
    }
    #[cfg(not(feature = "pjrt"))]
    {
        let _ = opts;
        reexec("aot", args)
    }
}

/// The entry point of `cargo xtask bench`; `args` are the arguments after `bench`.
pub fn bench(args: &[String]) -> Result<(), String> {
    let Some(opts) =
        crate::bench::parse_args(args).map_err(|e| format!("xtask bench: {e}\n\n{}", crate::bench::USAGE))?
    else {
        println!("{}", crate::bench::USAGE);
        return Ok(());
    };
    if let (true, Some(markdown)) = (opts.render, &opts.markdown) {
        for written in crate::results::update(markdown, Vec::new())? {
            println!("bench: wrote {}", written.display());
        }
        return Ok(());
    }
    #[cfg(feature = "pjrt")]
    {
        crate::pjrt_cmds::bench::run(&opts, args)
    }
    #[cfg(not(feature = "pjrt"))]
    {
        let _ = opts;
        reexec("bench", args)
    }
}

/// The entry point of `cargo xtask gpu-bench`; `args` are the arguments after `gpu-bench`.
pub fn gpu_bench(args: &[String]) -> Result<(), String> {
    let Some(opts) = crate::gpu_bench::parse_args(args)
        .map_err(|e| format!("xtask gpu-bench: {e}\n\n{}", crate::gpu_bench::USAGE))?
    else {
        println!("{}", crate::gpu_bench::USAGE);
        return Ok(());
    };
    #[cfg(feature = "pjrt")]
    {
        crate::pjrt_cmds::gpu_bench::run(&opts)
    }
    #[cfg(not(feature = "pjrt"))]
    {
        let _ = opts;
        reexec("gpu-bench", args)
    }
}

/// The entry point of `cargo xtask demo`.
pub fn demo(args: &[String]) -> Result<(), String> {
    match args.iter().map(String::as_str).collect::<Vec<_>>()[..] {
        [] => {}
        ["--ref-only"] => return crate::demo::reference().map(|_| ()),
        ["-h" | "--help"] => {
            println!("{}", crate::demo::USAGE);
            return Ok(());
        }
        _ => {
            return Err(format!(
                "xtask demo: unexpected arguments `{}`\n\n{}",
                args.join(" "),
                crate::demo::USAGE
            ))
        }
    }
    #[cfg(feature = "pjrt")]
    {
        crate::pjrt_cmds::demo::run()
    }
    #[cfg(not(feature = "pjrt"))]
    {
        reexec("demo", args)
    }
}

/// Runs `cargo xtask CMD ARGS` again with the `pjrt` feature.
#[cfg(not(feature = "pjrt"))]
fn reexec(cmd: &str, args: &[String]) -> Result<(), String> {
    let mut all = vec![cmd.to_string()];
    all.extend(args.iter().cloned());
    crate::cargo_cmd::reexec_with_pjrt(&all)
}
