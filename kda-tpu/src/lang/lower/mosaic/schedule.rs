//! The order the Mosaic lowering writes a body's ops in: a greedy list schedule of the body's
//! dependence graph on a small model of a TensorCore (vector, load, store, transcendental and
//! cross-lane units, two MXUs). The TPU compiler schedules each basic block itself, but the
//! order it is given decides much of what it finds: written chunk by chunk, a step's products
//! wait on each other; ordered by this model, in which a product's result comes back only
//! after [`MXU_LATENCY`] cycles, the independent work of every chunk of the step fills those
//! waits (docs/kernels/op-order.md).
//!
//! Only the order of the top-level ops changes: every op still follows what it reads, loads
//! and stores of one buffer keep their order, and regions (`when`, `for`) keep their insides.

use std::collections::HashMap;

use crate::hlo::TensorType;
use crate::lang::ir::{Offset, Op, Ref, V};

/// The model's cycles from a product's issue to its result. Far above a real MXU's latency on
/// purpose: it makes the schedule take every product whose inputs are ready, from any chunk,
/// before any product that waits on another (the static counts at other latencies:
/// docs/performance.md, Design figures).
pub const MXU_LATENCY: f64 = 500.0;

/// The units of the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Unit {
    Vector,
    Load,
    Store,
    Transcendental,
    CrossLane,
    Mxu,
    /// Index arithmetic, views and constants: no unit, no time.
    None,
}

/// The values `op` reads (a region's insides included) and the buffers it reads or writes
/// (`writes` set when it writes any).
fn reads(op: &Op, vals: &mut Vec<u32>, refs: &mut Vec<Ref>, writes: &mut bool) {
    let offsets = |o: &[Offset], vals: &mut Vec<u32>| {
        vals.extend(o.iter().filter_map(|x| match x {
            Offset::Dyn(v, _) => Some(v.id),
            Offset::Const(_) => None,
        }))
    };
    let mut v = |x: &V| vals.push(x.id);
    match op {
        Op::ProgramId { .. } | Op::IndexConst { .. } | Op::Splat { .. } | Op::Iota { .. } => {}
        Op::IndexBinary { a, b, .. }
        | Op::Binary { a, b, .. }
        | Op::Compare { a, b, .. }
        | Op::Matmul { a, b, .. } => {
            v(a);
            v(b)
        }
        Op::ReadTable { index, .. } => v(index),
        Op::Cumsum { a, starts, .. } => {
            v(a);
            if let Some(s) = starts {
                v(s)
            }
        }
        Op::Unary { a, .. }
        | Op::Reduce { a, .. }
        | Op::Broadcast { a, .. }
        | Op::Cast { a, .. }
        | Op::Transpose { a, .. }
        | Op::Reshape { a, .. }
        | Op::Slice { a, .. } => v(a),
        Op::Select { cond, a, b, .. } => {
            v(cond);
            v(a);
            v(b)
        }
        Op::Concat { parts, .. } => parts.iter().for_each(v),
        Op::Load { from, offsets: o, rows, .. } => {
            rows.iter().for_each(&mut v);
            refs.push(*from);
            offsets(o, vals)
        }
        Op::Store { to, offsets: o, value, rows } => {
            rows.iter().for_each(&mut v);
            vals.push(value.id);
            refs.push(*to);
            *writes = true;
            offsets(o, vals)
        }
        Op::If { cond, then } => {
            v(cond);
            for o in then {
                reads(o, vals, refs, writes);
            }
        }
        Op::For { init, until, body, .. } => {
            init.iter().for_each(&mut v);
            until.iter().for_each(&mut v);
            for o in body {
                reads(o, vals, refs, writes);
            }
        }
    }
}

/// The values `op` defines.
fn defines(op: &Op) -> Vec<u32> {
    match op {
        Op::ProgramId { out, .. }
        | Op::IndexConst { out, .. }
        | Op::IndexBinary { out, .. }
        | Op::ReadTable { out, .. }
        | Op::Splat { out, .. }
        | Op::Load { out, .. }
        | Op::Matmul { out, .. }
        | Op::Binary { out, .. }
        | Op::Unary { out, .. }
        | Op::Iota { out, .. }
        | Op::Compare { out, .. }
        | Op::Select { out, .. }
        | Op::Reduce { out, .. }
        | Op::Cumsum { out, .. }
        | Op::Broadcast { out, .. }
        | Op::Cast { out, .. }
        | Op::Transpose { out, .. }
        | Op::Reshape { out, .. }
        | Op::Slice { out, .. }
        | Op::Concat { out, .. } => vec![out.id],
        Op::Store { .. } | Op::If { .. } => vec![],
        Op::For { outs, .. } => outs.iter().map(|o| o.id).collect(),
    }
}

/// `a / b` rounded up, for positive `b`.
fn ceil(a: i64, b: i64) -> i64 {
    (a + b - 1) / b
}

/// Vector registers of a value: `8 x 128` of a 32-bit type, `16 x 128` of a 16-bit one.
fn vregs(t: &TensorType) -> f64 {
    let Some((&lanes, rows)) = t.dims.split_last() else { return 0.0 };
    let rows: i64 = rows.iter().product();
    let per = if t.elem.bit_width() == 16 { 16 } else { 8 };
    (ceil(rows, per) * ceil(lanes, 128)) as f64
}

/// The unit `op` occupies, its cycles there and the cycles after them until its result is
/// ready. A product costs a cycle per register of its result and of its right operand (what
/// the MXU takes in as weights).
fn cost(op: &Op) -> (Unit, f64, f64) {
    match op {
        Op::Matmul { out, a, b, contract, .. } => {
            let (k, n) = (a.ty.dims[contract.0], b.ty.dims[1 - contract.1]);
            let weights = (ceil(k, 16) * ceil(n, 128)) as f64;
            (Unit::Mxu, vregs(&out.ty) + weights, MXU_LATENCY)
        }
        Op::Binary { out, .. } | Op::Select { out, .. } | Op::Compare { out, .. } | Op::Cast { out, .. } => {
            (Unit::Vector, vregs(&out.ty) / 4.0, 2.0)
        }
        Op::Unary { out, .. } => (Unit::Transcendental, vregs(&out.ty), 8.0),
        Op::Load { out, .. } => (Unit::Load, vregs(&out.ty) / 3.0, 2.0),
        Op::Store { value, .. } => (Unit::Store, vregs(&value.ty) / 2.0, 1.0),
        Op::Transpose { out, .. } | Op::Reduce { out, .. } => (Unit::CrossLane, vregs(&out.ty), 8.0),
        Op::Broadcast { out, .. } => (Unit::CrossLane, vregs(&out.ty) / 2.0, 2.0),
        Op::If { .. } | Op::For { .. } => (Unit::None, 1.0, 1.0),
        _ => (Unit::None, 0.0, 0.0),
    }
}

/// Each op's predecessors: the ops defining what it reads, and for a buffer the last op that
/// wrote it (and, for a write, every read since).
fn predecessors(ops: &[Op]) -> Vec<Vec<usize>> {
    let mut producer = HashMap::new();
    let mut last_write: HashMap<Ref, usize> = HashMap::new();
    let mut reads_since: HashMap<Ref, Vec<usize>> = HashMap::new();
    let mut preds = vec![vec![]; ops.len()];
    for (i, op) in ops.iter().enumerate() {
        let (mut vals, mut refs, mut writes) = (vec![], vec![], false);
        reads(op, &mut vals, &mut refs, &mut writes);
        let p = &mut preds[i];
        p.extend(vals.iter().filter_map(|v| producer.get(v).copied()));
        // A region may write what it touches.
        let writes = writes || matches!(op, Op::If { .. } | Op::For { .. });
        for r in refs {
            p.extend(last_write.get(&r).copied());
            if writes {
                p.extend(reads_since.remove(&r).unwrap_or_default());
                last_write.insert(r, i);
            } else {
                reads_since.entry(r).or_default().push(i);
            }
        }
        p.sort_unstable();
        p.dedup();
        for id in defines(op) {
            producer.insert(id, i);
        }
    }
    preds
}

/// `ops` in the order of a greedy schedule on the model: repeatedly the ready op (every
/// predecessor placed) that can start first, ties to the longer path to the end, then to the
/// written order. With a `window` `(ahead, of)`, ops more than `ahead / of` of the body past
/// the first op not yet placed wait while a nearer one is ready: a body built chunk by chunk
/// then has about `ahead` of its `of` chunks in flight, not all of them.
pub(crate) fn schedule(ops: &[Op], window: Option<(u32, u32)>) -> Vec<Op> {
    let n = ops.len();
    let preds = predecessors(ops);
    let mut succs = vec![vec![]; n];
    for (i, ps) in preds.iter().enumerate() {
        for &p in ps {
            succs[p].push(i);
        }
    }
    let costs: Vec<_> = ops.iter().map(cost).collect();
    let mut path = vec![0f64; n];
    for i in (0..n).rev() {
        let tail = succs[i].iter().map(|&s| path[s]).fold(0.0, f64::max);
        path[i] = costs[i].1 + costs[i].2 + tail;
    }
    // When each unit is next free (two MXUs), and when each placed op's result is ready.
    let mut free: HashMap<Unit, f64> = HashMap::new();
    let mut mxus = [0f64; 2];
    let mut done = vec![0f64; n];
    let mut missing: Vec<usize> = preds.iter().map(Vec::len).collect();
    // The ready ops, each with the time its inputs are ready (fixed once every predecessor is
    // placed).
    let mut ready: Vec<(usize, f64)> = (0..n).filter(|&i| missing[i] == 0).map(|i| (i, 0.0)).collect();
    let mut order = Vec::with_capacity(n);
    let reach = window.map_or(n, |(ahead, of)| n * ahead as usize / of.max(1) as usize);
    let mut placed = vec![false; n];
    let mut first = 0;
    while !ready.is_empty() {
        let start = |&(i, inputs): &(usize, f64)| {
            let unit = match costs[i].0 {
                Unit::None => 0.0,
                Unit::Mxu => mxus[0].min(mxus[1]),
                u => free.get(&u).copied().unwrap_or(0.0),
            };
            inputs.max(unit)
        };
        while first < n && placed[first] {
            first += 1;
        }
        let far = |i: usize| u8::from(i >= first + reach);
        let key = |r: &(usize, f64)| (far(r.0), start(r), -path[r.0], r.0);
        let pos = (0..ready.len())
            .min_by(|&x, &y| key(&ready[x]).partial_cmp(&key(&ready[y])).unwrap_or(std::cmp::Ordering::Equal))
            .unwrap_or(0);
        let s = start(&ready[pos]);
        let (i, _) = ready.swap_remove(pos);
        let (unit, busy, latency) = costs[i];
        match unit {
            Unit::None => {}
            Unit::Mxu => {
                let m = usize::from(mxus[1] < mxus[0]);
                mxus[m] = s + busy;
            }
            u => {
                free.insert(u, s + busy);
            }
        }
        done[i] = s + busy + latency;
        placed[i] = true;
        order.push(i);
        for &x in &succs[i] {
            missing[x] -= 1;
            if missing[x] == 0 {
                let inputs = preds[x].iter().map(|&p| done[p]).fold(0.0, f64::max);
                ready.push((x, inputs));
            }
        }
    }
    order.into_iter().map(|i| ops[i].clone()).collect()
}

#[cfg(test)]
mod tests {
    use super::{predecessors, schedule, Op};
    use crate::hlo::TensorType;
    use crate::lang::{Binary, Body, KernelBuilder, MatPrecision, Operand, Ref, Semantics, V};
    use kda_core::DType;

    /// The body of a one-step kernel of a `[64, 128]` f32 input `x`, result `o` and scratch
    /// `s`.
    fn body(f: impl FnOnce(&mut Body, [Ref; 3]) -> crate::Result<()>) -> Vec<Op> {
        let mut k = KernelBuilder::new("k");
        k.grid(1, Semantics::Parallel);
        let ty = TensorType::new(DType::F32, &[64, 128]);
        let x = k.input(Operand::whole("x", ty.clone()));
        let o = k.output(Operand::whole("o", ty.clone()));
        let s = k.scratch("s", ty);
        k.build(|b| f(b, [x, o, s])).expect("the body builds").body
    }

    /// Where the op that `key` picks out sits in `order`.
    fn at(order: &[Op], key: impl Fn(&Op) -> bool) -> usize {
        order.iter().position(key).expect("the op is scheduled")
    }

    fn defining(id: u32) -> impl Fn(&Op) -> bool {
        move |op| super::defines(op).contains(&id)
    }

    fn storing(id: u32) -> impl Fn(&Op) -> bool {
        move |op| matches!(op, Op::Store { value, .. } if value.id == id)
    }

    /// `x x^T x`: two dependent products.
    fn chain(b: &mut Body, x: &V) -> crate::Result<(V, V)> {
        let p = b.matmul(x, x, (1, 1), MatPrecision::Highest)?;
        let q = b.matmul(&p, x, (1, 0), MatPrecision::Highest)?;
        Ok((p, q))
    }

    /// Every op once, each after every op it depends on.
    fn assert_a_valid_order(ops: &[Op], order: &[Op]) {
        assert_eq!(ops.len(), order.len());
        let text = |o: &[Op]| {
            let mut t: Vec<String> = o.iter().map(|x| format!("{x:?}")).collect();
            t.sort();
            t
        };
        assert_eq!(text(ops), text(order), "the same ops");
        let pos: Vec<usize> =
            ops.iter().map(|op| at(order, |o| format!("{o:?}") == format!("{op:?}"))).collect();
        for (i, ps) in predecessors(ops).iter().enumerate() {
            for &p in ps {
                assert!(pos[p] < pos[i], "op {i} placed before its predecessor {p}");
            }
        }
    }

    #[test]
    fn independent_products_fill_each_others_waits() {
        let (mut first, mut second) = (None, None);
        let ops = body(|b, [x, o, _]| {
            let a = b.load_all(x)?;
            let (p1, q1) = chain(b, &a)?;
            let c = b.load_all(x)?;
            let c = b.binary(Binary::Add, &c, &a)?;
            let (p2, q2) = chain(b, &c)?;
            first = Some((p1.id, q1.id));
            second = Some((p2.id, q2.id));
            let r = b.binary(Binary::Add, &q1, &q2)?;
            b.store_all(o, &r)
        });
        let ((p1, q1), (p2, _)) = (first.unwrap(), second.unwrap());
        let order = schedule(&ops, None);
        assert_a_valid_order(&ops, &order);
        // Written chain after chain; scheduled, the second chain's first product goes ahead of
        // the first chain's second, which waits on a result.
        assert!(at(&order, defining(p2)) < at(&order, defining(q1)));
        assert!(at(&order, defining(p1)) < at(&order, defining(p2)));
    }

    /// With a quarter of the body in reach (two of its eight ops past the first not yet placed),
    /// the second chain waits for the first: the first chain's dependent product goes ahead of
    /// the second's first one.
    #[test]
    fn a_window_keeps_later_chunks_waiting() {
        let (mut first, mut second) = (None, None);
        let ops = body(|b, [x, o, s]| {
            let a = b.load_all(x)?;
            let (p1, q1) = chain(b, &a)?;
            b.store_all(o, &q1)?;
            let c = b.load_all(x)?;
            let (p2, q2) = chain(b, &c)?;
            b.store_all(s, &q2)?;
            first = Some((p1.id, q1.id));
            second = Some(p2.id);
            Ok(())
        });
        let ((p1, q1), p2) = (first.unwrap(), second.unwrap());
        let free = schedule(&ops, None);
        assert!(at(&free, defining(p2)) < at(&free, defining(q1)), "without a window");
        assert_eq!(ops.len(), 8);
        let order = schedule(&ops, Some((1, 4)));
        assert_a_valid_order(&ops, &order);
        assert!(at(&order, defining(p1)) < at(&order, defining(q1)));
        assert!(at(&order, defining(q1)) < at(&order, defining(p2)));
    }

    #[test]
    fn a_buffers_loads_stores_and_regions_keep_their_order() {
        let mut ids = vec![];
        let ops = body(|b, [x, o, s]| {
            // A late value stored first, an early one second: the second store still waits.
            let a = b.load_all(x)?;
            let (_, late) = chain(b, &a)?;
            b.store_all(s, &late)?;
            let l1 = b.load_all(s)?;
            let early = b.load_all(x)?;
            b.store_all(s, &early)?;
            let l2 = b.load_all(s)?;
            let i = b.program_id(0)?;
            let zero = b.index(0)?;
            let first = b.compare(crate::hlo::Cmp::Eq, &i, &zero)?;
            b.when(&first, |b| b.store_all(s, &l1))?;
            let l3 = b.load_all(s)?;
            let out = b.binary(Binary::Add, &l2, &l3)?;
            b.store_all(o, &out)?;
            ids = vec![late.id, l1.id, early.id, l2.id, l3.id];
            Ok(())
        });
        let order = schedule(&ops, None);
        assert_a_valid_order(&ops, &order);
        let (late, l1, early, l2, l3) = (ids[0], ids[1], ids[2], ids[3], ids[4]);
        let region = at(&order, |o| matches!(o, Op::If { .. }));
        let seq = [
            at(&order, storing(late)),
            at(&order, defining(l1)),
            at(&order, storing(early)),
            at(&order, defining(l2)),
            region,
            at(&order, defining(l3)),
        ];
        assert!(seq.windows(2).all(|w| w[0] < w[1]), "{seq:?}");
    }
}
