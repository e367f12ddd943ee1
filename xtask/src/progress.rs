//! Progress of the long commands (bench, aot, demo): one line per step on stderr, with the time
//! since the command started. Plain text, so a terminal and a CI log read the same.

use std::sync::OnceLock;
use std::time::Instant;

static START: OnceLock<Instant> = OnceLock::new();

/// Prints `[   12.3 s] cmd: message` to stderr; the clock starts at the first call.
pub fn step(cmd: &str, message: impl std::fmt::Display) {
    let t = START.get_or_init(Instant::now).elapsed().as_secs_f64();
    eprintln!("{}", line(cmd, &message, t));
}

/// The text of one progress line.
pub fn line(cmd: &str, message: &dyn std::fmt::Display, seconds: f64) -> String {
    format!("[{seconds:>7.1} s] {cmd}: {message}")
}

#[cfg(test)]
mod tests {
    #[test]
    fn lines_carry_the_elapsed_time() {
        assert_eq!(super::line("bench", &"timing 10 runs...", 3.25), "[    3.2 s] bench: timing 10 runs...");
        assert_eq!(super::line("aot", &"loading libtpu...", 612.0), "[  612.0 s] aot: loading libtpu...");
    }
}
