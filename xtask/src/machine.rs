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
    /// UTC time of the run, `YYYY-MM-DD HH:MM UTC`.
    pub date: String,
    /// `git rev-parse --short HEAD`, with `-dirty` for uncommitted changes.
    pub commit: String,
}

impl Machine {
    /// Reads the machine's description now.
    pub fn collect() -> Machine {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        let cpu_model = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|s| cpu_model(&s))
            .unwrap_or_else(|| std::env::consts::ARCH.to_string());
        let secs = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
        Machine { cpus, cpu_model, date: utc(secs), commit: commit() }
    }

    /// One line: `2 CPUs, AMD EPYC ...`.
    pub fn summary(&self) -> String {
        format!("{} CPU{}, {}", self.cpus, if self.cpus == 1 { "" } else { "s" }, self.cpu_model)
    }
}

/// The first `model name` of a `/proc/cpuinfo` text.
fn cpu_model(cpuinfo: &str) -> Option<String> {
    cpuinfo
        .lines()
        .find_map(|l| l.split_once(':').filter(|(k, _)| k.trim() == "model name").map(|(_, v)| v.trim()))
        .map(|m| m.split_whitespace().collect::<Vec<_>>().join(" "))
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
}
