//! Regions a loop runs on some of its trips only. libtpu's software pipeline (Mosaic grids, XLA
//! tile loops) runs N = steps + 2 trips and puts the compute behind a branch on the loop's
//! iteration index: `p = pnand(i >= 1, i < N - 1)`, `sbr.rel (p) target = $regionR` jumps over
//! it on the first and last trips. A branch whose predicate is a function of the iteration
//! index alone (comparisons of it, or of it plus constants, with constants, combined by
//! `pnand`, `pand`, `por`, `pneg`) is evaluated on every trip; any other predicate (a block index
//! that changed, a value read at run time) is not, and its region counts on every trip.
//!
//! The index is the loop body's `sphi` whose comment names it `iteration index, stage = 0`,
//! starting from a register set to 0 (`smov.u32 0`) and running 0..N. The empty bundles right
//! after a branch (its delay slots) run either way; the skipped bundles run from the next one
//! to the bundle that starts region `R`.

use std::collections::HashMap;

/// What a bundle says about scalar registers and branches.
#[derive(Debug, Default)]
pub(super) struct Scalars {
    /// Definitions made in the bundle.
    defs: Vec<(String, Def)>,
    /// The register this bundle names the loop's iteration index (an `sphi`), and its initial
    /// value's register.
    index: Option<(String, String)>,
    /// `sbr.rel (p) target = $regionR`: the predicate, whether it is negated (`!p`), and `R`.
    branch: Option<(String, bool, u64)>,
    /// Regions starting at this bundle.
    starts: Vec<u64>,
}

/// A scalar definition the evaluation understands.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Def {
    Zero,
    AddConst(String, i64),
    Cmp(Cmp, String, i64),
    Nand(String, String),
    And(String, String),
    Or(String, String),
    Not(String),
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Cmp {
    Lt,
    Le,
    Gt,
    Ge,
    Eq,
    Ne,
}

/// Reads one bundle's text (`ADDR MARK: > { op ;; op } /* comment */`).
pub(super) fn scalars(text: &str) -> Scalars {
    let mut s = Scalars::default();
    let (body, tail) = match (text.find('{'), text.rfind('}')) {
        (Some(a), Some(b)) if a < b => (&text[a + 1..b], &text[b + 1..]),
        _ => return s,
    };
    for op in body.split(";;") {
        let (code, comment) = match op.find("/*") {
            Some(at) => (&op[..at], &op[at..]),
            None => (op, ""),
        };
        if let Some((lhs, rhs)) = code.split_once(" = ") {
            let (lhs, rhs) = (lhs.trim(), rhs.trim());
            if rhs.starts_with("sphi ")
                && comment.split("::").any(|c| clean(c) == "iteration index, stage = 0")
            {
                if let Some(init) = rhs["sphi ".len()..].split(',').next() {
                    s.index = Some((lhs.to_string(), init.trim().to_string()));
                }
            }
            if let Some(target) = rhs.strip_prefix("sbr.rel ") {
                s.branch = branch(target);
            } else if let Some(d) = def(rhs) {
                s.defs.push((lhs.to_string(), d));
            }
        }
    }
    for part in tail.split("::") {
        let p = clean(part);
        if let Some(r) = p.strip_prefix("Start region ").or_else(|| p.strip_prefix("Start/End empty region "))
        {
            if let Ok(r) = r.trim().parse() {
                s.starts.push(r);
            }
        }
    }
    s
}

/// A comment part without its `/*`, `*/` and spaces.
fn clean(part: &str) -> &str {
    part.trim().trim_start_matches("/*").trim_end_matches("*/").trim()
}

/// `(p) target = $regionR` or `(!p) target = $regionR`.
fn branch(rest: &str) -> Option<(String, bool, u64)> {
    let inner = rest.trim().strip_prefix('(')?;
    let (pred, after) = inner.split_once(')')?;
    let (pred, negated) = match pred.trim().strip_prefix('!') {
        Some(p) => (p, true),
        None => (pred.trim(), false),
    };
    let region = after.trim().strip_prefix("target = $region")?.trim().parse().ok()?;
    Some((pred.to_string(), negated, region))
}

/// The definitions the evaluation understands; others are `None`.
fn def(rhs: &str) -> Option<Def> {
    let (op, args) = rhs.split_once(' ')?;
    let args: Vec<&str> = args.split(',').map(str::trim).collect();
    let constant = |a: &str| -> Option<i64> {
        let x: i64 = a.parse().ok()?;
        // 32-bit immediates: 4294967295 is -1.
        Some(if x > i64::from(i32::MAX) { x - (1 << 32) } else { x })
    };
    let two = || -> Option<(String, String)> {
        match args.as_slice() {
            [a, b] if a.starts_with('%') && b.starts_with('%') => Some((a.to_string(), b.to_string())),
            _ => None,
        }
    };
    match op {
        "smov.u32" => (args.as_slice() == ["0"]).then_some(Def::Zero),
        "sadd.s32" => match args.as_slice() {
            [a, b] if a.starts_with('%') => Some(Def::AddConst(a.to_string(), constant(b)?)),
            [a, b] if b.starts_with('%') => Some(Def::AddConst(b.to_string(), constant(a)?)),
            _ => None,
        },
        "pnand" => two().map(|(a, b)| Def::Nand(a, b)),
        "pand" => two().map(|(a, b)| Def::And(a, b)),
        "por" => two().map(|(a, b)| Def::Or(a, b)),
        "pneg" => match args.as_slice() {
            [a] if a.starts_with('%') => Some(Def::Not(a.to_string())),
            _ => None,
        },
        _ => {
            let cmp = match op.strip_prefix("scmp.")?.split('.').collect::<Vec<_>>().as_slice() {
                [c, "s32", ..] => match *c {
                    "lt" => Cmp::Lt,
                    "le" => Cmp::Le,
                    "gt" => Cmp::Gt,
                    "ge" => Cmp::Ge,
                    "eq" => Cmp::Eq,
                    "ne" => Cmp::Ne,
                    _ => return None,
                },
                _ => return None,
            };
            match args.as_slice() {
                [a, b] if a.starts_with('%') => Some(Def::Cmp(cmp, a.to_string(), constant(b)?)),
                _ => None,
            }
        }
    }
}

/// The scalar definitions of a whole listing (SSA names: each defined once).
pub(super) fn definitions<'a>(all: impl Iterator<Item = &'a Scalars>) -> HashMap<String, Def> {
    all.flat_map(|s| s.defs.iter().cloned()).collect()
}

/// A loop body's evaluator: its iteration index and the listing's definitions.
pub(super) struct Trips<'a> {
    defs: &'a HashMap<String, Def>,
    index: String,
}

impl<'a> Trips<'a> {
    /// The loop whose body's bundles are `body`, when one of them names an iteration index that
    /// starts from 0.
    pub(super) fn of(defs: &'a HashMap<String, Def>, body: &[&Scalars]) -> Option<Self> {
        let (index, init) = body.iter().find_map(|s| s.index.clone())?;
        (defs.get(&init) == Some(&Def::Zero)).then_some(Trips { defs, index })
    }

    /// On how many of `trips` trips (index 0..trips) the bundle's branch jumps, when its
    /// predicate is a function of the index alone.
    pub(super) fn taken(&self, s: &Scalars, trips: u64) -> Option<u64> {
        let (pred, negated, _) = s.branch.as_ref()?;
        let mut n = 0;
        for i in 0..trips as i64 {
            if self.predicate(pred, i, 0)? != *negated {
                n += 1;
            }
        }
        Some(n)
    }

    fn register(&self, name: &str, i: i64, depth: usize) -> Option<i64> {
        if name == self.index {
            return Some(i);
        }
        match self.defs.get(name)? {
            Def::AddConst(r, c) if depth < 16 => Some(self.register(r, i, depth + 1)? + c),
            _ => None,
        }
    }

    fn predicate(&self, name: &str, i: i64, depth: usize) -> Option<bool> {
        if depth > 32 {
            return None;
        }
        let p = |n: &str| self.predicate(n, i, depth + 1);
        Some(match self.defs.get(name)? {
            Def::Cmp(c, r, k) => {
                let x = self.register(r, i, depth + 1)?;
                match c {
                    Cmp::Lt => x < *k,
                    Cmp::Le => x <= *k,
                    Cmp::Gt => x > *k,
                    Cmp::Ge => x >= *k,
                    Cmp::Eq => x == *k,
                    Cmp::Ne => x != *k,
                }
            }
            Def::Nand(a, b) => !(p(a)? && p(b)?),
            Def::And(a, b) => p(a)? && p(b)?,
            Def::Or(a, b) => p(a)? || p(b)?,
            Def::Not(a) => !p(a)?,
            Def::Zero | Def::AddConst(..) => return None,
        })
    }
}

/// Where the branch at `at` among a loop body's bundles `body` lands: the later bundle that
/// starts its target region.
pub(super) fn target(body: &[&Scalars], at: usize) -> Option<usize> {
    let (_, _, region) = body[at].branch.as_ref()?;
    (at + 1..body.len()).find(|&k| body[k].starts.contains(region))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_pipeline_guard() {
        let s = scalars("  0x27   : > { %p366_p11 = pnand %p7, %p10 } /* End region 45 */");
        assert_eq!(s.defs, vec![("%p366_p11".to_string(), Def::Nand("%p7".into(), "%p10".into()))]);
        let s = scalars("  0x28   : > { %369 = sbr.rel (%p366_p11) target = $region48 }");
        assert_eq!(s.branch, Some(("%p366_p11".to_string(), false, 48)));
        let s =
            scalars("0x161d PF: > { %p5 = scmp.ge.s32.totalorder %s30, 2 } /* Start/End empty region 48 */");
        assert_eq!(s.starts, vec![48]);
        assert_eq!(s.defs, vec![("%p5".to_string(), Def::Cmp(Cmp::Ge, "%s30".into(), 2))]);
        let s = scalars("  0x1e LB: > { %s11 = sadd.s32 4294967295, %s30 /* iteration index, stage = 1 */  ;;  %s30 = sphi %s26, %s37 /* phi copy :: iteration index, stage = 0 */  ;;  %s29 = sphi %s9, %s8 /* iteration index, stage = 0 iter bound = 0 */ } /* Start region 100 :: Start region 45 */");
        assert_eq!(s.index, Some(("%s30".to_string(), "%s26".to_string())));
        assert_eq!(s.defs, vec![("%s11".to_string(), Def::AddConst("%s30".into(), -1))]);
        assert_eq!(s.starts, vec![100, 45]);
    }
}
