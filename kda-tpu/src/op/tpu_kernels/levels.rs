//! The level hierarchy of a chunk's pairs ([`super::terms::chunk_terms`]): the size of the
//! level-0 blocks and the levels above them, chosen from the gate's bound.

use kda_core::GateKind;

use super::super::chunk::{C, GATE_FLOOR};

/// The hierarchy of [`super::terms::chunk_terms`]: a pair `j < t` of one chunk falls in one `base`-token
/// block (level 0, factored through the block's second token), or its tokens first part at
/// block size `B` of [`Levels::halves`]: in the two halves of one block of `2B` (the level of
/// `B`). Level 0's factors reach `e^((base - 2) |g|)` for the largest `|g|` of the chunk: 4-token
/// blocks keep them within `e^60` under the floor of -30; a lower-bound gate bounds `|g|` by
/// `|lb|`, and [`Levels::for_gate`] takes 16-token blocks where that keeps them within `e^80`
/// (two levels fewer).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Levels {
    /// Tokens of a level-0 block: 4, 8 or 16.
    pub base: i64,
}

impl Levels {
    /// 4-token level-0 blocks, for any gate.
    pub const FINE: Levels = Levels { base: 4 };

    /// The largest level-0 block whose factors stay within `e^80` under `gate`: 16 or 8 tokens
    /// for a lower bound `lb` with `(base - 2) |lb| <= 80`, else 4 (the floor of -30).
    pub fn for_gate(gate: GateKind) -> Levels {
        let bound = match gate {
            GateKind::LowerBound(lb) if lb.is_finite() => lb.abs(),
            _ => f64::from(-GATE_FLOOR as f32),
        };
        let base = [16, 8].into_iter().find(|&n| (n - 2) as f64 * bound <= LEVEL0_EXPONENT).unwrap_or(4);
        Levels { base }
    }

    /// Whether level 0 spans more than 4 tokens: its mid anchor's row and column terms then
    /// cancel on up to `base - 2` tokens, and the backward takes its factors and that array's
    /// gradient in two bf16 parts (docs/kernels/tpu-backward.md, The gate's gradient).
    pub fn wide_level0(&self) -> bool {
        self.base > Self::FINE.base
    }

    /// The block sizes `B` of the levels above 0: `base` to 32.
    pub fn halves(&self) -> Vec<i64> {
        std::iter::successors(Some(self.base), |&h| (h < C / 2).then_some(2 * h)).collect()
    }

    /// Rows of the stacked exponent masks ([`super::terms::term_masks_kernel`]): `G`, the suffix, the mid
    /// anchor and one per level above 0, `[64, 64]` each.
    pub fn exponent_rows(&self) -> i64 {
        (3 + self.halves().len() as i64) * C
    }

    /// Row of the stacked level masks where the symmetric masks of the levels above 0 start.
    pub fn level_pairs(&self) -> i64 {
        (1 + self.halves().len() as i64) * 2 * C
    }

    /// Rows of the stacked level masks ([`super::terms::term_masks_kernel`]).
    pub fn level_rows(&self) -> i64 {
        self.level_pairs() + (self.halves().len() as i64 + 1) * C
    }
}

/// The largest exponent (natural units) a level-0 factor may reach ([`Levels::for_gate`]):
/// `e^80` and its products with unit-norm rows stay far inside f32 and bf16.
const LEVEL0_EXPONENT: f64 = 80.0;

#[cfg(test)]
mod tests {
    use super::Levels;
    use kda_core::GateKind;
    use rstest::rstest;

    #[rstest]
    #[case::preactivated(GateKind::Preactivated, 4)]
    #[case::softplus(GateKind::Softplus, 4)]
    #[case::lower_bound_5(GateKind::LowerBound(-5.0), 16)]
    #[case::lower_bound_10(GateKind::LowerBound(-10.0), 8)]
    #[case::lower_bound_14(GateKind::LowerBound(-14.0), 4)]
    fn level0_blocks_follow_the_gate_bound(#[case] gate: GateKind, #[case] base: i64) {
        let lv = Levels::for_gate(gate);
        assert_eq!(lv.base, base);
        let bound = match gate {
            GateKind::LowerBound(lb) => lb.abs(),
            _ => 30.0,
        };
        assert!((base - 2) as f64 * bound <= 80.0 || base == 4, "{lv:?}");
        let halves = lv.halves();
        assert_eq!(halves.first(), Some(&base));
        assert_eq!(halves.last(), Some(&32));
        // G, the suffix and the mid anchor, then one exponent array per level above 0.
        assert_eq!(lv.exponent_rows(), (3 + halves.len() as i64) * 64);
    }
}
