//! Cross-replica collectives: programs compiled for several replicas (one per device) exchange
//! values inside the program, in groups of replica ids.

use super::builder::FnBuilder;
use super::error::{err, Result};
use super::ops_reduce::Combiner;
use super::types::{TensorType, Value};

/// `replica_groups = dense<[[0, 1, ...]]>`: one group of `replicas` replicas.
fn one_group(op: &str, replicas: usize) -> Result<String> {
    if replicas == 0 {
        return Err(err(op, "a replica group needs at least one replica"));
    }
    let ids: Vec<String> = (0..replicas).map(|i| i.to_string()).collect();
    Ok(format!("replica_groups = dense<[[{}]]> : tensor<1x{replicas}xi64>", ids.join(", ")))
}

impl FnBuilder {
    /// The elementwise sum of `v` over `replicas` replicas; every replica gets the sum.
    pub fn all_reduce_sum(&mut self, v: Value, replicas: usize) -> Result<Value> {
        let op = "all_reduce_sum";
        let attrs = one_group(op, replicas)?;
        let body = self.combiner_region(op, Combiner::Add, v.elem())?;
        let mut out = self.push_op(op, "stablehlo.all_reduce", &[v], &[body], &attrs, &[v.ty()])?;
        out.pop().ok_or_else(|| err(op, "internal: no result"))
    }

    /// `v` of every one of `replicas` replicas, concatenated along `dim` in replica order.
    pub fn all_gather(&mut self, v: Value, dim: usize, replicas: usize) -> Result<Value> {
        let op = "all_gather";
        if dim >= v.rank() {
            return Err(err(op, format!("dim {dim} invalid for {}", v.ty())));
        }
        let mut dims = v.dims().to_vec();
        dims[dim] *= replicas as i64;
        let attrs = format!("all_gather_dim = {dim} : i64, {}", one_group(op, replicas)?);
        self.push_op1(op, "stablehlo.all_gather", &[v], &attrs, TensorType::new(v.elem(), &dims))
    }
}

impl FnBuilder {
    /// `values` unchanged, with a scheduling fence: nothing that reads a result starts before
    /// every one of `values` is computed (`stablehlo.optimization_barrier`). Sequences
    /// independent phases whose intermediates would otherwise be live together.
    pub fn optimization_barrier(&mut self, values: &[Value]) -> Result<Vec<Value>> {
        let types: Vec<TensorType> = values.iter().map(Value::ty).collect();
        self.push_op("optimization_barrier", "stablehlo.optimization_barrier", values, &[], "", &types)
    }
}
