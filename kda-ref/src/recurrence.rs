//! The token recurrence of docs/kda.md, Recurrence and its exact reverse-mode adjoint, in f64.
//!
//! Per token: `S <- Diag(exp g) S`; `S <- S + beta k (v - S^T k)^T`; `o = S^T (scale q)`.
//! The state is `K x V`, row-major (row = key channel).

use crate::prepare::Prepared;

/// Tokens between two saved states in the backward: one chunk.
pub(crate) const CHECKPOINT_EVERY: usize = kda_core::CHUNK;

/// One token of one sequence, borrowed from the prepared tensors.
struct Token<'a> {
    q: &'a [f64],
    k: &'a [f64],
    v: &'a [f64],
    g: &'a [f64],
    beta: f64,
}

impl Prepared {
    fn token(&self, h: usize, b: usize, t: usize) -> Token<'_> {
        let d = &self.p.dims;
        let row = (h * d.b + b) * d.t + t;
        Token {
            q: &self.q[row * d.k..(row + 1) * d.k],
            k: &self.k[row * d.k..(row + 1) * d.k],
            v: &self.v[row * d.v..(row + 1) * d.v],
            g: &self.g[row * d.k..(row + 1) * d.k],
            beta: self.beta[row],
        }
    }
}

/// Decays `s` in place (`S <- Diag(exp g) S`) and returns the residual `r = v - S^T k`.
fn decay_and_residual(s: &mut [f64], tok: &Token, kd: usize, vd: usize) -> Vec<f64> {
    for i in 0..kd {
        let a = tok.g[i].exp();
        s[i * vd..(i + 1) * vd].iter_mut().for_each(|x| *x *= a);
    }
    let mut r = tok.v.to_vec();
    for i in 0..kd {
        for j in 0..vd {
            r[j] -= s[i * vd + j] * tok.k[i];
        }
    }
    r
}

/// Decay then delta-rule write; returns the residual `r = v - S_decayed^T k`.
fn step(s: &mut [f64], tok: &Token, kd: usize, vd: usize) -> Vec<f64> {
    let r = decay_and_residual(s, tok, kd, vd);
    for i in 0..kd {
        let bk = tok.beta * tok.k[i];
        for j in 0..vd {
            s[i * vd + j] += bk * r[j];
        }
    }
    r
}

/// Forward results in head-first working form.
pub(crate) struct ForwardResult {
    /// `[H,B,T,V]`, zero at padding tokens.
    pub o: Vec<f64>,
    /// `[B,N,H,K,V]`.
    pub final_state: Vec<f64>,
    /// Per `(h, b, n)`, the state entering every `CHECKPOINT_EVERY`-th token of the segment.
    pub checkpoints: Vec<Vec<Vec<f64>>>,
}

/// Runs the recurrence over every head, row and segment.
pub(crate) fn forward(p: &Prepared, keep_checkpoints: bool) -> ForwardResult {
    let d = p.p.dims;
    let (kd, vd) = (d.k, d.v);
    let mut o = vec![0.0; d.h * d.b * d.t * vd];
    let mut final_state = vec![0.0; d.b * d.n * d.h * kd * vd];
    let mut checkpoints = Vec::new();
    for h in 0..d.h {
        for (b, row) in p.p.segments.rows().iter().enumerate() {
            for (n, range) in row.iter().enumerate() {
                let base = d.state_index(b, n, h, 0, 0);
                let mut s = p.h0[base..base + kd * vd].to_vec();
                let mut saved = Vec::new();
                for (local, t) in range.clone().enumerate() {
                    if keep_checkpoints && local % CHECKPOINT_EVERY == 0 {
                        saved.push(s.clone());
                    }
                    let tok = p.token(h, b, t);
                    step(&mut s, &tok, kd, vd);
                    let out = &mut o[((h * d.b + b) * d.t + t) * vd..][..vd];
                    for i in 0..kd {
                        let sq = p.p.scale * tok.q[i];
                        for j in 0..vd {
                            out[j] += s[i * vd + j] * sq;
                        }
                    }
                }
                final_state[base..base + kd * vd].copy_from_slice(&s);
                checkpoints.push(saved);
            }
        }
    }
    ForwardResult { o, final_state, checkpoints }
}

/// Gradients in head-first working form, before the norm and gate chains.
pub(crate) struct RawGradients {
    /// dL/d(normalised q), `[H,B,T,K]`.
    pub dq: Vec<f64>,
    /// dL/d(normalised k).
    pub dk: Vec<f64>,
    /// `[H,B,T,V]`.
    pub dv: Vec<f64>,
    /// dL/d(activated g), `[H,B,T,K]`.
    pub dg: Vec<f64>,
    /// `[H,B,T]`.
    pub dbeta: Vec<f64>,
    /// `[B,N,H,K,V]`.
    pub dh0: Vec<f64>,
}

/// The adjoint of [`forward`] for the loss `sum(o * do) + sum(final_state * dht)`.
///
/// `checkpoints` are the forward's saved states (saved-state strategy) or `None`, in which
/// case they are recomputed here (rematerialised strategy).
pub(crate) fn backward(
    p: &Prepared,
    d_o: &[f64],
    dht: &[f64],
    checkpoints: Option<&[Vec<Vec<f64>>]>,
) -> RawGradients {
    let recomputed;
    let checkpoints = match checkpoints {
        Some(c) => c,
        None => {
            recomputed = forward(p, true).checkpoints;
            &recomputed
        }
    };
    let d = p.p.dims;
    let (kd, vd) = (d.k, d.v);
    let tokens = d.h * d.b * d.t;
    let mut g = RawGradients {
        dq: vec![0.0; tokens * kd],
        dk: vec![0.0; tokens * kd],
        dv: vec![0.0; tokens * vd],
        dg: vec![0.0; tokens * kd],
        dbeta: vec![0.0; tokens],
        dh0: vec![0.0; d.b * d.n * d.h * kd * vd],
    };
    let mut seq = 0;
    for h in 0..d.h {
        for (b, row) in p.p.segments.rows().iter().enumerate() {
            for (n, range) in row.iter().enumerate() {
                let base = d.state_index(b, n, h, 0, 0);
                let mut ds = dht[base..base + kd * vd].to_vec();
                let saved = &checkpoints[seq];
                seq += 1;
                for (c, start) in saved.iter().enumerate().rev() {
                    let first = range.start + c * CHECKPOINT_EVERY;
                    let last = (first + CHECKPOINT_EVERY).min(range.end);
                    // States entering each token of this chunk.
                    let mut entering = Vec::with_capacity(last - first);
                    let mut s = start.clone();
                    for t in first..last {
                        entering.push(s.clone());
                        step(&mut s, &p.token(h, b, t), kd, vd);
                    }
                    for t in (first..last).rev() {
                        token_adjoint(p, &mut g, &mut ds, &entering[t - first], h, b, t, d_o);
                    }
                }
                g.dh0[base..base + kd * vd].copy_from_slice(&ds);
            }
        }
    }
    g
}

/// Pulls `ds` (dL/d state after token t) back through token t, accumulating its gradients.
#[allow(clippy::too_many_arguments)]
fn token_adjoint(
    p: &Prepared,
    g: &mut RawGradients,
    ds: &mut [f64],
    entering: &[f64],
    h: usize,
    b: usize,
    t: usize,
    d_o: &[f64],
) {
    let d = p.p.dims;
    let (kd, vd) = (d.k, d.v);
    let row = (h * d.b + b) * d.t + t;
    let tok = p.token(h, b, t);
    let dout = &d_o[row * vd..(row + 1) * vd];
    // Recompute the decayed state, the residual and the state after the write.
    let mut sd = entering.to_vec();
    let r = decay_and_residual(&mut sd, &tok, kd, vd);
    // o = S^T (scale q), S = sd + beta k r^T.
    for i in 0..kd {
        let mut acc = 0.0;
        for j in 0..vd {
            let s_ij = sd[i * vd + j] + tok.beta * tok.k[i] * r[j];
            acc += s_ij * dout[j];
            ds[i * vd + j] += p.p.scale * tok.q[i] * dout[j];
        }
        g.dq[row * kd + i] = p.p.scale * acc;
    }
    // S = sd + beta k r^T.
    let mut dr = vec![0.0; vd];
    let mut dbeta = 0.0;
    for i in 0..kd {
        let mut ds_r = 0.0;
        for j in 0..vd {
            let x = ds[i * vd + j];
            ds_r += x * r[j];
            dr[j] += tok.beta * tok.k[i] * x;
        }
        dbeta += tok.k[i] * ds_r;
        g.dk[row * kd + i] = tok.beta * ds_r;
    }
    g.dbeta[row] = dbeta;
    // r = v - sd^T k.
    g.dv[row * vd..(row + 1) * vd].copy_from_slice(&dr);
    for i in 0..kd {
        let mut sd_dr = 0.0;
        let mut dgi = 0.0;
        let a = tok.g[i].exp();
        for j in 0..vd {
            sd_dr += sd[i * vd + j] * dr[j];
            let dsd = ds[i * vd + j] - tok.k[i] * dr[j];
            dgi += sd[i * vd + j] * dsd;
            // sd = Diag(exp g) entering.
            ds[i * vd + j] = a * dsd;
        }
        g.dk[row * kd + i] -= sd_dr;
        g.dg[row * kd + i] = dgi;
    }
}
