//! Data parallelism's host side: a batch's rows spread over D devices in contiguous blocks of
//! `ceil(B / D)` rows, each row whole on one device (its segments never split), the last blocks
//! padded with zero rows; and the results gathered back in batch order without the padding.

use kda_core::{HostTensor, KdaError, Layout, Problem, Result, SegmentTable};

/// The batch axis of per-token tensors and `beta` in `layout` (states: axis 0).
pub fn batch_axis(layout: Layout) -> usize {
    match layout {
        Layout::HeadFirst => 1,
        Layout::BatchFirst => 0,
    }
}

/// How B rows spread over D devices: `per` rows each, the real ones first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowPlan {
    /// Devices.
    pub devices: usize,
    /// Rows per device (real and padding).
    pub per: usize,
    b: usize,
}

impl RowPlan {
    /// `b` rows over `devices` devices (at least one).
    pub fn new(b: usize, devices: usize) -> Self {
        let devices = devices.max(1);
        Self { devices, per: b.div_ceil(devices), b }
    }
    /// Device `d`'s first row in the batch.
    pub fn start(&self, d: usize) -> usize {
        d * self.per
    }
    /// How many of device `d`'s rows are real (the rest are padding).
    pub fn real(&self, d: usize) -> usize {
        self.b.saturating_sub(self.start(d)).min(self.per)
    }

    /// Device `d`'s problem: `per` rows, the global N (so every device runs one program), its
    /// rows' segments, and one whole-row segment for each padding row.
    pub fn shard(&self, p: &Problem, d: usize) -> Result<Problem> {
        let mut q = p.clone();
        q.dims.b = self.per;
        q.beta_shape[batch_axis(p.layout)] = self.per;
        let t = p.dims.t;
        q.segments = if p.segments.is_packed() {
            // A padding row: one whole-row segment, then empty ones up to N.
            let padding: Vec<_> =
                std::iter::once(0..t).chain(std::iter::repeat_n(t..t, p.dims.n - 1)).collect();
            let rows = (0..self.per)
                .map(|i| p.segments.rows().get(self.start(d) + i).cloned().unwrap_or_else(|| padding.clone()))
                .collect();
            SegmentTable::from_ranges(t, rows)?
        } else {
            SegmentTable::fixed(self.per, t)
        };
        Ok(q)
    }

    /// Each device's real rows of `parts` (one tensor per device), joined along `axis`.
    pub fn gather(&self, parts: Vec<HostTensor>, axis: usize) -> Result<HostTensor> {
        let kept = parts
            .iter()
            .enumerate()
            .filter(|(d, _)| self.real(*d) > 0)
            .map(|(d, t)| t.slice_padded(axis, 0, self.real(d)))
            .collect::<Result<Vec<_>>>()?;
        HostTensor::concat(&kept, axis)
    }

    /// [`RowPlan::gather`] of tensors every device has or none has.
    pub fn gather_opt(&self, parts: Vec<Option<HostTensor>>, axis: usize) -> Result<Option<HostTensor>> {
        match parts.into_iter().collect::<Option<Vec<_>>>() {
            Some(ts) => Ok(Some(self.gather(ts, axis)?)),
            None => Ok(None),
        }
    }
}

/// The whole batch's problem of shards that share dims (rows joined in device order).
pub fn join_problems<'p>(shards: impl Iterator<Item = &'p Problem>) -> Result<Problem> {
    let shards: Vec<&Problem> = shards.collect();
    let first = shards.first().ok_or_else(|| KdaError::value("inputs", "one shard per device", "none"))?;
    let mut p = (*first).clone();
    let b: usize = shards.iter().map(|s| s.dims.b).sum();
    p.dims.b = b;
    p.beta_shape[batch_axis(p.layout)] = b;
    let rows = shards.iter().flat_map(|s| s.segments.rows().iter().cloned()).collect();
    p.segments = SegmentTable::from_ranges(p.dims.t, rows)?;
    if !first.segments.is_packed() {
        p.segments = SegmentTable::fixed(b, p.dims.t);
    }
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::RowPlan;
    use rstest::rstest;

    #[rstest]
    #[case::even(4, 2, vec![2, 2])]
    #[case::padded_last(3, 2, vec![2, 1])]
    #[case::more_devices_than_rows(1, 4, vec![1, 0, 0, 0])]
    fn rows_spread_real_first(#[case] b: usize, #[case] devices: usize, #[case] real: Vec<usize>) {
        let plan = RowPlan::new(b, devices);
        assert_eq!((0..devices).map(|d| plan.real(d)).collect::<Vec<_>>(), real);
        assert!(plan.per * devices >= b);
    }
}
