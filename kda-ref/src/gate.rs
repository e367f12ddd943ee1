//! Gate activations (docs/kda.md, Tensors) and their derivatives, in f64.

use kda_core::GateKind;

/// The gate parameters of one head and key channel.
#[derive(Debug, Clone, Copy)]
pub(crate) struct GateParams {
    pub a_log: f64,
    pub dt_bias: f64,
}

fn softplus(z: f64) -> f64 {
    // ln(1 + e^z) without overflow for large z and without cancellation for very negative z.
    if z > 0.0 {
        z + (-z).exp().ln_1p()
    } else {
        z.exp().ln_1p()
    }
}

fn sigmoid(z: f64) -> f64 {
    if z >= 0.0 {
        1.0 / (1.0 + (-z).exp())
    } else {
        let e = z.exp();
        e / (1.0 + e)
    }
}

/// The log-decay `g` from the gate input `x`.
pub(crate) fn activate(kind: GateKind, x: f64, p: GateParams) -> f64 {
    match kind {
        GateKind::Preactivated => x,
        GateKind::Softplus => -p.a_log.exp() * softplus(x + p.dt_bias),
        GateKind::LowerBound(lb) => lb * sigmoid(p.a_log.exp() * (x + p.dt_bias)),
    }
}

/// `(dg/dx, dg/da_log)`; `dg/ddt_bias` equals `dg/dx`.
pub(crate) fn derivatives(kind: GateKind, x: f64, p: GateParams) -> (f64, f64) {
    match kind {
        GateKind::Preactivated => (1.0, 0.0),
        GateKind::Softplus => {
            let a = p.a_log.exp();
            let z = x + p.dt_bias;
            (-a * sigmoid(z), -a * softplus(z))
        }
        GateKind::LowerBound(lb) => {
            let a = p.a_log.exp();
            let z = a * (x + p.dt_bias);
            let s = sigmoid(z);
            let ds = lb * s * (1.0 - s);
            (ds * a, ds * z)
        }
    }
}
