//! A static cycle count from libtpu's final bundle listings (the method of
//! `shared/docs/TPU_CYCLES.md`): every bundle is one issue cycle; loops count their body times
//! their trip count, calls (`inlined_call` in the top-level program) the callee's count. A
//! Mosaic grid, or any loop, that ends in `scmp.ge.s32 .., N /* loop exit test */` runs N
//! times; an XLA `while` of the top-level program takes its trip count from the HLO condition
//! (`compare(i, constant(N)), direction=LT`); a loop whose count is neither is counted once and
//! reported. A region behind a branch on the loop's iteration index alone (the software
//! pipeline's guard: [`super::guards`]) counts on the trips it runs; other predicated regions
//! count in full (the longest path). A model, not a time: stalls are not in it.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use super::guards::{self, Def, Scalars, Trips};
pub use super::units::Units;
use crate::error::{Result, TpuError};

/// The flags that make libtpu write the listings this module reads into `dir`; put them in
/// `LIBTPU_INIT_ARGS` before libtpu is loaded.
pub fn listing_flags(dir: &Path) -> String {
    format!(
        "--xla_jf_dump_to={} --xla_jf_dump_llo_pass_label_regex=final_bundles|deduplication-map",
        dir.display()
    )
}

/// A program's static cycle count.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StaticCycles {
    /// Bundles along the executed path, loops times their trip counts.
    pub total: u64,
    /// The part inside Mosaic kernels.
    pub kernels: u64,
    /// Loops whose trip count is unknown statically (counted once).
    pub unknown_loops: usize,
    /// Bytes the DMAs along the path move (`size_in_granules` x 32 per DMA issued), kernels and
    /// XLA ops alike. DMAs behind the pipeline's guard count on the trips they run, other
    /// predicated DMAs on every step (a result block's write-back, issued only when its block
    /// index changes, counts on each): an upper bound.
    pub dma_bytes: u64,
    /// Each Mosaic kernel's share, by its module name (`module @name` of its body).
    pub per_kernel: BTreeMap<String, KernelShare>,
    /// The ops along the path by unit ([`Units`]), kernels and XLA ops alike.
    pub units: Units,
}

/// One Mosaic kernel's share of a program's count, over all its calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct KernelShare {
    /// Bundles along the path.
    pub bundles: u64,
    /// Bytes its DMAs move.
    pub dma_bytes: u64,
    /// Times it runs.
    pub calls: u64,
    /// Its ops along the path by unit.
    pub units: Units,
}

/// The bytes of one DMA granule.
const GRANULE_BYTES: u64 = 32;

#[derive(Debug)]
struct Bundle {
    depth: usize,
    loop_body: bool,
    exit_trips: Option<u64>,
    /// Bytes the bundle's DMAs move.
    dma_bytes: u64,
    /// The callee (`inlined_call`).
    call: Option<String>,
    /// Whether it holds no op (a delay slot).
    empty: bool,
    /// Its scalar definitions and branch, for guards on a loop's index.
    scalars: Scalars,
    /// Its ops by unit.
    units: Units,
}

/// The bundles of one listing.
fn bundles(text: &str) -> Vec<Bundle> {
    let mut out: Vec<(Bundle, String)> = Vec::new();
    for line in text.lines() {
        match bundle_head(line) {
            Some((depth, loop_body)) => {
                let b = Bundle {
                    depth,
                    loop_body,
                    exit_trips: None,
                    dma_bytes: 0,
                    call: None,
                    empty: false,
                    scalars: Scalars::default(),
                    units: Units::default(),
                };
                out.push((b, line.to_string()))
            }
            None => {
                if let Some((_, t)) = out.last_mut() {
                    t.push('\n');
                    t.push_str(line);
                }
            }
        }
    }
    // An empty bundle (`{}`, a delay slot) carries no nesting marks even inside a loop: it
    // belongs to the shallower of its neighbours, so a loop is not cut at its delay slots.
    let empty: Vec<bool> = out.iter().map(|(_, t)| empty_bundle(t)).collect();
    for i in 0..out.len() {
        if empty[i] && out[i].0.depth == 0 {
            let prev = out[..i].iter().rev().zip(empty[..i].iter().rev()).find(|(_, &e)| !e);
            let next = out[i + 1..].iter().zip(&empty[i + 1..]).find(|(_, &e)| !e);
            if let (Some(((p, _), _)), Some(((n, _), _))) = (prev, next) {
                out[i].0.depth = p.depth.min(n.depth);
            }
        }
    }
    out.into_iter()
        .map(|(mut b, t)| {
            b.exit_trips = exit_trips(&t);
            b.dma_bytes = dma_bytes(&t);
            b.call = call(&t);
            b.empty = empty_bundle(&t);
            b.scalars = guards::scalars(&t);
            b.units = super::units::of_bundle(&t);
            b
        })
        .collect()
}

/// Whether a bundle's text holds no op: `ADDR [MARK]: {}` and perhaps a comment.
fn empty_bundle(t: &str) -> bool {
    t.split_once('{').is_some_and(|(_, rest)| rest.trim_start().starts_with('}'))
}

/// `ADDR [MARK]: [>..] {`: the nesting depth and whether the bundle starts a loop body.
fn bundle_head(line: &str) -> Option<(usize, bool)> {
    let s = line.trim_start();
    let addr_end = s.find(|c: char| c.is_whitespace())?;
    let addr = &s[..addr_end];
    let hex = addr.strip_prefix("0x").map(|h| !h.is_empty() && h.chars().all(|c| c.is_ascii_hexdigit()));
    if !(addr == "0" || hex == Some(true)) {
        return None;
    }
    let rest = s[addr_end..].trim_start();
    let (mark, rest) = rest.split_once(':')?;
    let mark = mark.trim();
    if !(mark.is_empty() || (mark.len() == 2 && mark.chars().all(|c| c.is_ascii_uppercase()))) {
        return None;
    }
    let rest = rest.trim_start();
    let depth = rest.chars().take_while(|&c| c == '>').count();
    rest[depth..].trim_start().starts_with('{').then_some((depth, mark == "LB"))
}

fn exit_trips(t: &str) -> Option<u64> {
    let at = t.find("/* loop exit test */")?;
    let before = t[..at].trim_end();
    let n = before.rsplit([',', ' ']).next()?;
    n.parse().ok()
}

/// The bytes a bundle's DMAs move: `/*size_in_granules=*/N` granules each.
fn dma_bytes(t: &str) -> u64 {
    t.split("/*size_in_granules=*/")
        .skip(1)
        .filter_map(|r| r.split(|c: char| !c.is_ascii_digit()).next()?.parse::<u64>().ok())
        .map(|g| g * GRANULE_BYTES)
        .sum()
}

fn call(t: &str) -> Option<String> {
    let at = t.find("= inlined_call")?;
    let rest = &t[at + "= inlined_call".len()..];
    if !rest.starts_with([' ', '\n']) {
        return None;
    }
    let c = rest.find("/* ")?;
    let comment = &rest[c + 3..];
    let name = comment.split([' ', '*']).next()?.trim_start_matches('%');
    (!name.is_empty()).then(|| name.to_string())
}

/// While loops of the top-level HLO: the computation holding each instruction, and each body
/// computation's trip count (`None` when its condition is not `i < constant`).
#[derive(Default)]
struct Hlo {
    computation_of: HashMap<String, String>,
    trips_of_body: HashMap<String, Option<u64>>,
    /// The Mosaic kernels (`custom_call_target="tpu_custom_call"`) and their module names.
    kernels: HashMap<String, String>,
}

fn hlo(text: &str) -> Hlo {
    let mut h = Hlo::default();
    let mut current = String::new();
    let mut conditions: HashMap<String, Vec<String>> = HashMap::new();
    let mut whiles: Vec<(String, String)> = Vec::new();
    for line in text.lines() {
        if !line.starts_with(' ') && line.trim_end().ends_with('{') {
            let head = line.trim_start_matches("ENTRY ").trim_start();
            current = head.split([' ', '(']).next().unwrap_or("").trim_start_matches('%').to_string();
            continue;
        }
        let s = line.trim_start().trim_start_matches("ROOT ");
        let Some(name) = s.strip_prefix('%').and_then(|r| r.split(' ').next()) else { continue };
        h.computation_of.insert(name.to_string(), current.clone());
        if s.contains("custom_call_target=\"tpu_custom_call\"") {
            h.kernels.insert(name.to_string(), kernel_name(s).unwrap_or_else(|| name.to_string()));
        }
        conditions.entry(current.clone()).or_default().push(s.to_string());
        if s.contains(" while(") {
            let attr = |key: &str| {
                s.split(key).nth(1).map(|r| {
                    r.split([',', ' ', '}']).next().unwrap_or("").trim_start_matches('%').to_string()
                })
            };
            if let (Some(c), Some(b)) = (attr("condition="), attr("body=")) {
                whiles.push((c, b));
            }
        }
    }
    for (cond, body) in whiles {
        let lines = conditions.get(&cond).map(Vec::as_slice).unwrap_or(&[]);
        let lt = lines.iter().any(|l| l.contains(" compare(") && l.contains("direction=LT"));
        let constant = lines
            .iter()
            .filter(|l| {
                l.split("= ").nth(1).is_some_and(|t| t.starts_with("s32[]")) && l.contains(" constant(")
            })
            .filter_map(|l| l.split("constant(").nth(1)?.split(')').next()?.parse::<u64>().ok())
            .next();
        h.trips_of_body.insert(body, if lt { constant } else { None });
    }
    h
}

/// The module name of a Mosaic custom call (`module @name` at the start of its base64 body).
fn kernel_name(instruction: &str) -> Option<String> {
    let at = instruction.find("\"body\":\"")? + "\"body\":\"".len();
    let head: String = instruction[at..].chars().take_while(|c| *c != '"').take(96).collect();
    let text = decode_base64(&head[..head.len() / 4 * 4])?;
    let rest = text.strip_prefix("module @")?;
    Some(rest.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).next()?.to_string())
}

/// Standard base64 (RFC 4648) without padding handling beyond `=`, as text.
fn decode_base64(s: &str) -> Option<String> {
    let value = |c: u8| match c {
        b'A'..=b'Z' => Some(c - b'A'),
        b'a'..=b'z' => Some(c - b'a' + 26),
        b'0'..=b'9' => Some(c - b'0' + 52),
        b'+' => Some(62),
        b'/' => Some(63),
        _ => None,
    };
    let mut out = Vec::new();
    for quad in s.as_bytes().chunks(4) {
        let digits: Vec<u8> =
            quad.iter().take_while(|&&c| c != b'=').map(|&c| value(c)).collect::<Option<_>>()?;
        let bits = digits.iter().fold(0u32, |acc, &d| acc << 6 | u32::from(d)) << (6 * (4 - digits.len()));
        out.extend(bits.to_be_bytes()[1..].iter().take(digits.len().saturating_sub(1)));
    }
    String::from_utf8(out).ok()
}

/// One listing as the count walks it: its bundles, its scalar definitions (for guards) and
/// whether it is the top-level program (whose `while`s take their trips from the HLO).
struct Parsed<'a> {
    b: &'a [Bundle],
    defs: &'a HashMap<String, Def>,
    top: bool,
}

struct Listings {
    files: HashMap<String, PathBuf>,
    alias: HashMap<String, String>,
    hlo: Hlo,
    memo: HashMap<String, StaticCycles>,
}

impl Listings {
    fn cycles_of(&mut self, name: &str, kernel: Option<&str>) -> Result<StaticCycles> {
        let key = self.alias.get(name).cloned().unwrap_or_else(|| name.to_string());
        if let Some(c) = self.memo.get(&key) {
            return Ok(c.clone());
        }
        let Some(path) = self.files.get(&key).cloned() else {
            // A callee without a listing (an empty region): no bundles of its own.
            return Ok(StaticCycles::default());
        };
        let text = std::fs::read_to_string(&path).map_err(|e| io(&path, e))?;
        let b = bundles(&text);
        let defs = guards::definitions(b.iter().map(|x| &x.scalars));
        let listing = Parsed { b: &b, defs: &defs, top: key == "TLP" };
        let mut c = self.region(&listing, (0, b.len()), 0)?;
        if let Some(module) = kernel {
            c.kernels = c.total;
            let share = KernelShare { bundles: c.total, dma_bytes: c.dma_bytes, calls: 1, units: c.units };
            c.per_kernel = BTreeMap::from([(module.to_string(), share)]);
        }
        self.memo.insert(key, c.clone());
        Ok(c)
    }

    /// Bundles `from..to` of `l` at nesting `depth` (deeper runs are loops).
    fn region(&mut self, l: &Parsed, (from, to): (usize, usize), depth: usize) -> Result<StaticCycles> {
        let (b, top) = (l.b, l.top);
        let mut c = StaticCycles::default();
        let mut i = from;
        while i < to {
            if b[i].depth <= depth {
                c.total += 1;
                c.dma_bytes += b[i].dma_bytes;
                c.units.add(&b[i].units, 1);
                if let Some(name) = &b[i].call {
                    let kernel = self.hlo.kernels.get(name).cloned();
                    let name = name.clone();
                    add(&mut c, &self.cycles_of(&name, kernel.as_deref())?, 1);
                }
                i += 1;
                continue;
            }
            // One loop: a run deeper than `depth`, split where a sibling loop body starts.
            let mut j = i + 1;
            while j < to && b[j].depth > depth && !(b[j].depth == depth + 1 && b[j].loop_body) {
                j += 1;
            }
            let exit =
                b[i..j].iter().filter(|x| x.depth == depth + 1).filter_map(|x| x.exit_trips).next_back();
            let trips = exit.or_else(|| if top { self.while_trips(&b[i..j], depth + 1) } else { None });
            match trips {
                Some(n) => {
                    let looped = self.guarded_loop(l, (i, j), depth + 1, n)?;
                    add(&mut c, &looped, 1);
                }
                None => {
                    c.unknown_loops += 1;
                    let body = self.region(l, (i, j), depth + 1)?;
                    add(&mut c, &body, 1);
                }
            }
            i = j;
        }
        Ok(c)
    }

    /// A loop of `trips` trips whose body is bundles `from..to` of `l` at `depth`: each region
    /// behind a branch on its iteration index counted on the trips it runs, the rest on every
    /// trip.
    fn guarded_loop(
        &mut self,
        l: &Parsed,
        (from, to): (usize, usize),
        depth: usize,
        trips: u64,
    ) -> Result<StaticCycles> {
        let b = l.b;
        let level: Vec<usize> = (from..to).filter(|&k| b[k].depth == depth).collect();
        let scalars: Vec<&Scalars> = level.iter().map(|&k| &b[k].scalars).collect();
        let mut c = StaticCycles::default();
        let mut cursor = from;
        if let Some(index) = Trips::of(l.defs, &scalars) {
            let mut at = 0;
            while at < level.len() {
                let guard = index.taken(scalars[at], trips).zip(guards::target(&scalars, at));
                let Some((skips, landing)) = guard else {
                    at += 1;
                    continue;
                };
                // The branch's delay slots (the empty bundles after it) run either way.
                let mut start = level[at] + 1;
                while start < level[landing] && b[start].empty {
                    start += 1;
                }
                let end = level[landing];
                add(&mut c, &self.region(l, (cursor, start), depth)?, trips);
                add(&mut c, &self.region(l, (start, end), depth)?, trips - skips);
                cursor = end;
                at = landing;
            }
        }
        add(&mut c, &self.region(l, (cursor, to), depth)?, trips);
        Ok(c)
    }

    /// The trip count of the XLA `while` whose body holds the loop's first call at its level.
    fn while_trips(&self, b: &[Bundle], depth: usize) -> Option<u64> {
        let first = b.iter().filter(|x| x.depth == depth).find_map(|x| x.call.as_ref())?;
        let body = self.hlo.computation_of.get(first)?;
        self.hlo.trips_of_body.get(body).copied().flatten()
    }
}

fn add(c: &mut StaticCycles, x: &StaticCycles, times: u64) {
    c.total += x.total * times;
    c.kernels += x.kernels * times;
    c.unknown_loops += x.unknown_loops;
    c.dma_bytes += x.dma_bytes * times;
    c.units.add(&x.units, times);
    for (name, k) in &x.per_kernel {
        let e = c.per_kernel.entry(name.clone()).or_default();
        e.bundles += k.bundles * times;
        e.dma_bytes += k.dma_bytes * times;
        e.calls += k.calls * times;
        e.units.add(&k.units, times);
    }
}

fn io(path: &Path, e: std::io::Error) -> TpuError {
    TpuError::Compile { message: format!("cannot read the listing {}: {e}", path.display()) }
}

/// The static cycle count of the one program whose listings are `files` (the files libtpu
/// wrote while compiling it: `*-final_bundles.txt`, `*-deduplication-map.txt`, `*-TLP-hlo.txt`).
pub fn count(files: &[PathBuf]) -> Result<StaticCycles> {
    let mut l =
        Listings { files: HashMap::new(), alias: HashMap::new(), hlo: Hlo::default(), memo: HashMap::new() };
    for f in files {
        let Some(name) = f.file_name().and_then(|n| n.to_str()) else { continue };
        // `<fingerprint>-<computation>-<NN>-<pass>.txt`.
        let Some((_, rest)) = name.split_once('-') else { continue };
        if let Some(stem) = rest.strip_suffix("-final_bundles.txt") {
            if let Some((computation, nn)) = stem.rsplit_once('-') {
                if nn.chars().all(|c| c.is_ascii_digit()) {
                    l.files.insert(computation.to_string(), f.clone());
                }
            }
        } else if rest.ends_with("-deduplication-map.txt") {
            let text = std::fs::read_to_string(f).map_err(|e| io(f, e))?;
            let mut key = String::new();
            for line in text.lines() {
                if let Some(k) = line.strip_prefix("key:") {
                    key = k.trim().to_string();
                } else if line.starts_with("  ") {
                    l.alias.insert(line.trim().to_string(), key.clone());
                }
            }
        } else if rest == "TLP-hlo.txt" {
            l.hlo = hlo(&std::fs::read_to_string(f).map_err(|e| io(f, e))?);
        }
    }
    if !l.files.contains_key("TLP") {
        return Err(TpuError::Compile {
            message: "no top-level bundle listing among the compile's files (was libtpu loaded with the listing flags?)"
                .to_string(),
        });
    }
    l.cycles_of("TLP", None)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, text).expect("write");
        p
    }

    /// The count of a top-level program listing `tlp` alone (written to a scratch folder `tag`).
    fn count_top_level(tag: &str, tlp: &str) -> StaticCycles {
        // A folder per call: the cases of one test run in parallel threads of one process.
        static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("kda-cycles-{tag}-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let files = vec![write(&dir, "1-TLP-02-final_bundles.txt", tlp)];
        let c = count(&files).expect("counted");
        std::fs::remove_dir_all(&dir).ok();
        c
    }

    /// A top-level program with a call, a `while` of 4 trips (from the HLO) and a kernel
    /// (`module @kda_k`) whose grid loop of three bundles, one a DMA of two granules, exits after
    /// ten trips: `3 + 4 * (2 + fusion 2) + kernel (1 + 10 * 3)` bundles and ten DMAs of 64 bytes.
    #[test]
    fn counts_loops_calls_and_kernels() {
        let dir = std::env::temp_dir().join(format!("kda-cycles-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let tlp = "header\n     0   :  { %1 = sld }\n   0x1 LB: > { %2 = inlined_call %s1 /* %fusion.3 = fusion(%a) */ }\n   0x2   : > { %3 = sadd }\n   0x3   :  { %4 = inlined_call %s2 /* %k.1 = custom-call(%b), custom_call_target=\"tpu_custom_call\" */ }\n   0x4   :  { %5 = inlined_call /* <late-finalization> */ }\n";
        let fusion = "     0   :  { %1 = vld }\n   0x1   :  { %2 = vst\n   multi-line comment */ }\n";
        let kernel = "     0   :  { %1 = inlined_call_operand.vmem [shape: s32[16]] }\n   0x1 LB: > { %2 = vld }\n   0x2   : > { %3 = dma.hbm_to_vmem /*hbm=*/%s1, /*size_in_granules=*/2, /*vmem=*/%s2 }\n   0x3   : > { %p = scmp.ge.s32.totalorder %s9, 10 /* loop exit test */ }\n";
        let hlo = "ENTRY %main (a: f32[]) -> f32[] {\n  %w = (s32[]) while(%t), condition=%cond, body=%body\n  %k.1 = f32[8]{0} custom-call(%b), custom_call_target=\"tpu_custom_call\", backend_config={\"custom_call_config\":{\"body\":\"bW9kdWxlIEBrZGFfayB7\"}}\n}\n\n%body (p: (s32[])) -> (s32[]) {\n  %fusion.3 = f32[] fusion(%a), kind=kLoop\n}\n\n%cond (p: (s32[])) -> pred[] {\n  %constant.1 = s32[]{:T(128)} constant(4)\n  ROOT %compare.2 = pred[] compare(%g, %constant.1), direction=LT\n}\n";
        let files = vec![
            write(&dir, "11-TLP-02-final_bundles.txt", tlp),
            write(&dir, "12-fusion.9-01-final_bundles.txt", fusion),
            write(&dir, "13-k.1-01-final_bundles.txt", kernel),
            write(&dir, "11-TLP-01-schedule-analysis_final_bundles.txt", "Schedule analysis:\n"),
            write(
                &dir,
                "11-TLP-00-deduplication-map.txt",
                "key:fusion.9\nordinal:1\nequivalent_hlos[size=1]:\n  fusion.3\n",
            ),
            write(&dir, "11-TLP-hlo.txt", hlo),
        ];
        let c = count(&files).expect("counted");
        std::fs::remove_dir_all(&dir).ok();
        let share = KernelShare { bundles: 31, dma_bytes: 10 * 2 * 32, calls: 1, units: Units::default() };
        let want = StaticCycles {
            total: 3 + 4 * (2 + 2) + (1 + 10 * 3),
            kernels: 31,
            unknown_loops: 0,
            dma_bytes: 10 * 2 * 32,
            per_kernel: BTreeMap::from([("kda_k".to_string(), share)]),
            units: Units::default(),
        };
        assert_eq!(c, want);
    }

    /// Empty bundles inside a loop (delay slots, no nesting marks) stay in the loop; those after
    /// it do not.
    #[test]
    fn empty_bundles_inside_a_loop_belong_to_it() {
        let tlp = "     0   :  { %1 = sld }\n   0x1 LB: > { %2 = sadd }\n   0x2   :  {}\n   0x3   : > { %3 = sadd }\n   0x4   : > { %p = scmp.ge.s32.totalorder %s9, 10 /* loop exit test */ }\n   0x5   :  { %4 = sbr.rel }\n   0x6   :  {}\n";
        assert_eq!(
            count_top_level("empty", tlp),
            StaticCycles { total: 1 + 4 * 10 + 2, ..Default::default() }
        );
    }

    /// A software-pipelined loop of 10 trips (8 steps): its 3-bundle compute region (two vector
    /// ALU ops) sits behind `pnand(i >= 1, i < 9)` and runs on 8 trips, the rest of the body (8
    /// bundles, the branch's delay slot among them) on all 10; a guard on anything but the index
    /// counts on every trip, as does one on an index that does not start from 0.
    #[rstest::rstest]
    #[case::on_the_index("scmp.lt.s32.totalorder %s2, 9", "0", 8)]
    #[case::on_the_index_plus_one("scmp.lt.s32.totalorder %s12, 10", "0", 8)]
    #[case::on_a_register("scmp.lt.s32.totalorder %s2, %s40", "0", 10)]
    #[case::from_an_unknown_start("scmp.lt.s32.totalorder %s2, 9", "%s0", 10)]
    fn a_region_guarded_by_the_loop_index_counts_on_its_trips(
        #[case] upper: &str,
        #[case] start: &str,
        #[case] runs: u64,
    ) {
        let tlp = format!(
            "     0   :  {{ %s1 = smov.u32 {start} }}\n\
               0x1 LB: > {{ %s2 = sphi %s1, %s9 /* phi copy :: iteration index, stage = 0 */  ;;  %s12 = sadd.s32 1, %s2 }} /* Start region 9 */\n\
               0x2   : > {{ %p3 = scmp.ge.s32.totalorder %s2, 1  ;;  %p4 = {upper} }}\n\
               0x3   : > {{ %p5 = pnand %p3, %p4 }}\n\
               0x4   : > {{ %6 = sbr.rel (%p5) target = $region7 }}\n\
               0x5   :  {{}}\n\
               0x6   : > {{ %7 = vadd.f32 %v1, %v2 }} /* Start region 6 */\n\
               0x7   : > {{ %8 = vmul.f32 %v1, %v2 }}\n\
               0x8   : > {{ %9 = vst [vmem:[#allocation3] sm:$0xff] }} /* End region 6 */\n\
               0x9 PF: > {{ %s9 = sadd.s32 1, %s2 }} /* Start/End empty region 7 */\n\
               0xa   : > {{ %p10 = scmp.ge.s32.totalorder %s9, 10 /* loop exit test */ }}\n\
               0xb   : > {{ %11 = sbr.rel (!%p10) target = $region9 }}\n\
               0xc   :  {{}}\n"
        );
        let units = Units { valu: 2 * runs, ..Default::default() };
        let want = StaticCycles { total: 1 + 8 * 10 + 3 * runs + 1, units, ..Default::default() };
        assert_eq!(count_top_level("guard", &tlp), want);
    }

    #[test]
    fn a_loop_without_a_count_is_counted_once_and_reported() {
        let tlp = "     0   :  { %1 = sld }\n   0x1 LB: > { %2 = sadd }\n   0x2   : > { %3 = sbr.rel }\n";
        assert_eq!(
            count_top_level("unknown", tlp),
            StaticCycles { total: 3, unknown_loops: 1, ..Default::default() }
        );
        assert!(count(&[]).is_err());
    }
}
