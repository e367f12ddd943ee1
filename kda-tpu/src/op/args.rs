//! A program's arguments: declared in the order and with the types of its
//! [`ProgramSignature`], and read by role ([`Args`]) by every implementation.

use super::hlo_ops::splat;
use super::interface::{ProgramKind, ProgramSignature};
use super::prep;
use super::spec::ProgramSpec;
use crate::hlo::{FnBuilder, Value};
use crate::Result;

/// Per-token log-decays below this are treated as this value. `exp(-30) ~ 9e-14`: the state
/// left after such a token is below f32 resolution relative to what follows, exactly as after a
/// hard reset (`g = -1000`), while the in-chunk cumulative sums stay small enough that their
/// differences keep f32 precision (a -1000 inside a chunk would cost ~6e-5 relative error in
/// every later decay factor of that chunk).
pub const GATE_FLOOR: f32 = super::chunk::GATE_FLOOR as f32;

/// The program arguments the kernels read, by role.
#[derive(Clone, Copy)]
pub(crate) struct Args {
    pub(crate) q: Value,
    pub(crate) k: Value,
    pub(crate) v: Value,
    pub(crate) g: Value,
    pub(crate) beta: Value,
    pub(crate) h0: Option<Value>,
    pub(crate) a_log: Option<Value>,
    pub(crate) dt_bias: Option<Value>,
    pub(crate) tables: ChunkTables,
    pub(crate) slot_token: Option<Value>,
    pub(crate) token_slot: Option<Value>,
    pub(crate) token_segment: Option<Value>,
}

/// Every argument of a program, declared in the order and with the types of its
/// [`ProgramSignature`] (the one description the runtime and callers read as well).
pub(crate) struct Declared {
    pub(crate) sig: ProgramSignature,
    values: Vec<Value>,
}

impl Declared {
    pub(crate) fn new(b: &mut FnBuilder, s: &ProgramSpec, kind: ProgramKind) -> Result<Declared> {
        let sig = ProgramSignature::of(s, kind);
        let values = sig.args.iter().map(|p| b.arg(p.ty.clone())).collect::<Result<_>>()?;
        Ok(Declared { sig, values })
    }

    /// Argument `name`, if the program takes it.
    pub(crate) fn get(&self, name: &str) -> Option<Value> {
        self.sig.arg_index(name).map(|i| self.values[i])
    }

    /// Argument `name`, which every program of the spec takes.
    pub(crate) fn need(&self, name: &str) -> Result<Value> {
        self.get(name).ok_or_else(|| {
            crate::TpuError::builder("declare", format!("internal: the signature has no argument `{name}`"))
        })
    }

    /// The forward inputs: `q k v g beta [h0] [a_log] [dt_bias] first last slot
    /// [slot_token token_slot token_segment]`.
    pub(crate) fn args(&self) -> Result<Args> {
        Ok(Args {
            q: self.need("q")?,
            k: self.need("k")?,
            v: self.need("v")?,
            g: self.need("g")?,
            beta: self.need("beta")?,
            h0: self.get("h0"),
            a_log: self.get("a_log"),
            dt_bias: self.get("dt_bias"),
            tables: ChunkTables {
                first: self.need("chunk_first")?,
                last: self.need("chunk_last")?,
                slot: self.need("chunk_slot")?,
                used: None,
            },
            slot_token: self.get("slot_token"),
            token_slot: self.get("token_slot"),
            token_segment: self.get("token_segment"),
        })
    }
}

pub(crate) fn state_tab(b: &mut FnBuilder, s: &ProgramSpec, x: Option<Value>) -> Result<Value> {
    match x {
        Some(x) => prep::state_table(b, s, x),
        None => splat(b, 0.0, &[s.lanes() as i64, s.slots() as i64, s.dims.k as i64, s.dims.v as i64]),
    }
}

/// Per-chunk segment tables (i32 `[NT]` each).
#[derive(Clone, Copy)]
pub(crate) struct ChunkTables {
    /// 1 at a segment's first chunk (the state resets there).
    pub(crate) first: Value,
    /// 1 at a segment's last chunk (its final state is written there).
    pub(crate) last: Value,
    /// The state slot of the chunk's segment.
    pub(crate) slot: Value,
    /// Packed programs: the chunk positions to visit, an i32 scalar (one past the last chunk
    /// that ends a segment). The unused positions after it hold only padding, so the sequential
    /// loops stop there; `None` visits every position.
    pub(crate) used: Option<Value>,
}
