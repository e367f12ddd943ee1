//! What a benchmark record says about where and when it ran.

use std::process::Command;
use std::time::{SystemTime, UNIX_EPOCH};

/// The machine and the source a run measured.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Machine {
    /// CPUs this process may use.
    pub cpus: usize,
    /// `model name` from `/proc/cpuinfo`.
    pub cpu_model: String,
    /// Family, model and widest vector extension (`family 25 model 1, AVX2`): virtual machines
    /// often report only a vendor name (`AMD EPYC`), and the CPU plugin's timings differ by tens
    /// of percent between generations behind that name (see docs/performance.md), so records say
    /// which one ran.
    pub cpu_detail: String,
    /// UTC time of the run, `YYYY-MM-DD HH:MM UTC`.
    pub date: String,
    /// `git rev-parse --short HEAD`, with `-dirty` for uncommitted changes.
    pub commit: String,
}

impl Machine {
    /// Reads the machine's description now.
    pub fn collect() -> Machine {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu_model = cpu_model(&info).unwrap_or_else(|| std::env::consts::ARCH.to_string());
        let secs = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
        Machine { cpus, cpu_model, cpu_detail: cpu_detail(&info), date: utc(secs), commit: commit() }
    }

    /// One line: `2 CPUs, AMD EPYC (family 25 model 1, AVX2)`.
    pub fn summary(&self) -> String {
        let plural = if self.cpus == 1 { "" } else { "s" };
        if self.cpu_detail.is_empty() {
            format!("{} CPU{plural}, {}", self.cpus, self.cpu_model)
        } else {
            format!("{} CPU{plural}, {} ({})", self.cpus, self.cpu_model, self.cpu_detail)
        }
    }
}

/// The first `model name` of a `/proc/cpuinfo` text.
fn cpu_model(cpuinfo: &str) -> Option<String> {
    field(cpuinfo, "model name").map(|m| m.split_whitespace().collect::<Vec<_>>().join(" "))
}

/// The first value of `key` in a `/proc/cpuinfo` text.
fn field<'a>(cpuinfo: &'a str, key: &str) -> Option<&'a str> {
    cpuinfo.lines().find_map(|l| l.split_once(':').filter(|(k, _)| k.trim() == key).map(|(_, v)| v.trim()))
}

/// `family F model M, EXT` from a `/proc/cpuinfo` text (x86: EXT is AVX-512, AVX2 or SSE, read
/// off the first CPU's flags); empty where the text has none of it (other architectures).
fn cpu_detail(cpuinfo: &str) -> String {
    let mut parts = Vec::new();
    if let (Some(f), Some(m)) = (field(cpuinfo, "cpu family"), field(cpuinfo, "model")) {
        parts.push(format!("family {f} model {m}"));
    }
    if let Some(flags) = field(cpuinfo, "flags") {
        let has = |x: &str| flags.split_whitespace().any(|f| f == x);
        parts.push(
            if has("avx512f") {
                "AVX-512"
            } else if has("avx2") {
                "AVX2"
            } else {
                "SSE"
            }
            .to_string(),
        );
    }
    parts.join(", ")
}

fn commit() -> String {
    let root = crate::cargo_cmd::root();
    let git = |args: &[&str]| {
        Command::new("git")
            .args(args)
            .current_dir(&root)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    match git(&["rev-parse", "--short", "HEAD"]) {
        Some(head) => {
            let dirty =
                git(&["status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.is_empty());
            if dirty {
                format!("{head}-dirty")
            } else {
                head
            }
        }
        None => "unknown".to_string(),
    }
}

/// `YYYY-MM-DD HH:MM UTC` for seconds since the Unix epoch (proleptic Gregorian calendar).
pub fn utc(secs: u64) -> String {
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Howard Hinnant's civil_from_days.
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02} {:02}:{:02} UTC", rem / 3600, rem % 3600 / 60)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;

    #[rstest]
    #[case(0, "1970-01-01 00:00 UTC")]
    #[case(951_782_400, "2000-02-29 00:00 UTC")]
    #[case(1_795_865_400, "2026-11-28 11:30 UTC")]
    fn formats_utc_dates(#[case] secs: u64, #[case] want: &str) {
        assert_eq!(utc(secs), want);
    }

    #[test]
    fn reads_the_cpu_model() {
        let info = "processor\t: 0\nmodel name\t: AMD   EPYC 7B13\nflags\t: x\n";
        assert_eq!(cpu_model(info).as_deref(), Some("AMD EPYC 7B13"));
        assert_eq!(cpu_model("processor : 0\n"), None);
    }

    #[rstest]
    #[case("cpu family\t: 25\nmodel\t\t: 1\nflags\t\t: fpu avx avx2 fma\n", "family 25 model 1, AVX2")]
    #[case(
        "cpu family\t: 25\nmodel\t\t: 17\nflags\t\t: avx2 avx512f avx512bw\n",
        "family 25 model 17, AVX-512"
    )]
    #[case("flags\t\t: fpu sse sse2\n", "SSE")]
    #[case("processor\t: 0\nBogoMIPS\t: 50.00\n", "")]
    fn reads_family_model_and_vector_width(#[case] info: &str, #[case] want: &str) {
        assert_eq!(cpu_detail(info), want);
    }
}
