//! A listing's ops by the unit they occupy, counted along the executed path beside the bundles,
//! so that a change to a kernel is measured by what it adds or removes on each unit.
//!
//! How an op of a bundle (`%x = NAME.SUFFIXES operands`) is classed, by its name:
//! - a spill store: `vst` whose destination is a spill slot (`vst [vmem:[#allocationN_spill]`:
//!   libtpu names the VMEM it allocates for spilled vregs `_spill`); a spill load likewise, `vld`
//!   from a `_spill` slot. Other `vld`/`vst` are the kernel's own loads and stores, not counted;
//! - an MXU push: `vmatprep`, `vmatpush*`, `vmatmul*` (each sends vregs to a matrix unit;
//!   results come back by `vpop ... .mrb`, not counted);
//! - a transcendental push: `vexp*`, `vlog*`, `vpow*`, `vrcp`, `vrsqrt`, `vsqrt`, `vtanh`,
//!   `vsin`, `vcos`, `verf` (sent to the EUP; results come back by `vpop.erf`);
//! - a vector ALU op: any other op on vregs (`v...`: arithmetic, compares, selects, packs,
//!   conversions, shifts, masks), but the cross-lane unit's (`vperm`, `vxpose`, `vbcast`, their
//!   `vpop`s), pops, loads and stores, and synchronisation (`vsync*`, `vwait`, `vdelay`,
//!   `vtrace`, `vset*`, `vrng`).

/// Ops along a path, by unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Units {
    /// Vector ALU ops.
    pub valu: u64,
    /// Stores of vregs to spill slots.
    pub spill_stores: u64,
    /// Loads of vregs from spill slots.
    pub spill_loads: u64,
    /// Pushes to the matrix units.
    pub mxu_pushes: u64,
    /// Pushes to the transcendental unit.
    pub transcendental_pushes: u64,
}

impl Units {
    /// `self + x * times`.
    pub(super) fn add(&mut self, x: &Units, times: u64) {
        self.valu += x.valu * times;
        self.spill_stores += x.spill_stores * times;
        self.spill_loads += x.spill_loads * times;
        self.mxu_pushes += x.mxu_pushes * times;
        self.transcendental_pushes += x.transcendental_pushes * times;
    }
}

const TRANSCENDENTAL: [&str; 10] =
    ["vexp", "vlog", "vpow", "vrcp", "vrsqrt", "vsqrt", "vtanh", "vsin", "vcos", "verf"];
const NOT_VALU: [&str; 16] = [
    "vld", "vst", "vpop", "vperm", "vxpose", "vbcast", "vsync", "vwait", "vdelay", "vtrace", "vset", "vrng",
    "vmatprep", "vmatpush", "vmatmul", "vstv",
];

/// The ops of one bundle's text by unit.
pub(super) fn of_bundle(text: &str) -> Units {
    let mut u = Units::default();
    let body = match (text.find('{'), text.rfind('}')) {
        (Some(a), Some(b)) if a < b => &text[a + 1..b],
        _ => return u,
    };
    for op in body.split(";;") {
        let code = op.split("/*").next().unwrap_or("");
        let Some((_, rhs)) = code.split_once(" = ") else { continue };
        let rhs = rhs.trim();
        let name = rhs.split([' ', '.']).next().unwrap_or("");
        if !name.starts_with('v') {
            continue;
        }
        let spill = rhs.contains("_spill]");
        if name == "vst" && spill {
            u.spill_stores += 1;
        } else if name == "vld" && spill {
            u.spill_loads += 1;
        } else if name.starts_with("vmatprep") || name.starts_with("vmatpush") || name.starts_with("vmatmul")
        {
            u.mxu_pushes += 1;
        } else if TRANSCENDENTAL.iter().any(|t| name.starts_with(t)) {
            u.transcendental_pushes += 1;
        } else if !NOT_VALU.iter().any(|n| name.starts_with(n)) {
            u.valu += 1;
        }
    }
    u
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A bundle of a kernel that spills: one store to a spill slot, one load from one, one
    /// ordinary load and store, two MXU pushes and a pop, an exponential and its pop, two vector
    /// ALU ops and a cross-lane permute.
    #[test]
    fn ops_are_classed_by_unit() {
        let text = "0x1152   : > { %100632 = vst [vmem:[#allocation137_spill] sm:$0xff] /*vst_source=*/%v88106_v30  ;;  %v37822_v15 = vpack.c.f32.bf16 %v56641_v62, %v56640_v25  ;;  %v36719_v33 = vpop.f32.mrb[187].mxu0  ;;  %56910 = vmatprep.subr.bf16.mxu0 %v37979_v13  ;;  %56887 = vmatmul.mubr.msk.bf16.vlgmr.msra.gmra.mrb[240].mxu0 %vm732_vm0, %v37822_v15  ;;  %v20948_v28 = vmul.f32 %v88106_v30, %v100635_v10  ;;  %58624 = vexp2.f32 %v62753_v14  ;;  %v88113_v56 = vpop.erf %60664  ;;  %v100641_v62 = vld [vmem:[#allocation450_spill] sm:$0xff]  ;;  %v61560_v0 = vld [vmem:[%s90844_s8] sm:$0xff] /* combined load */  ;;  %45460 = vst [vmem:[#allocation3 + $0x68] sm:$0xff] /*vst_source=*/%v45444_v13  ;;  %1 = vperm.xlu0 %v1  ;;  %p61351_p0 = pnand %p61350_p13, %p61541_p5 }";
        let want =
            Units { valu: 2, spill_stores: 1, spill_loads: 1, mxu_pushes: 2, transcendental_pushes: 1 };
        assert_eq!(of_bundle(text), want);
    }
}
