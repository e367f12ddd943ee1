"""fla-core's chunk_kda at the benchmark shapes of docs/kda.md, timed on this GPU for the device
check (`cargo xtask gpu-check` stages and runs it beside `xtask gpu-bench`): the forward alone
(under no_grad), and the forward plus backward() from a fixed dO (every input's gradient, the gate
parameters' included), as a training step runs it.

primary: H=8, T=1024, K=V=128, a pre-activated gate; secondary: H=32, T=8192 with the L2 norm and
the lower-bound gate (-5) in the kernel, safe_gate; secondary-packed: the same in 25 balanced
segments (cu_seqlens). bf16. Each shape's autotuning runs in warm-up calls outside the timed part,
so the timed calls use the configs it pinned; each timed call is a host wall-clock span ended by
torch.cuda.synchronize(); gradients are cleared outside it. Kernel launches of one call are
counted with torch.profiler, and its peak device memory (inputs, results and gradients
included: torch.cuda.max_memory_allocated) beside the compiler's peak of this library's
executables (`cargo xtask aot --target h200`).

usage: python3 fla_bench.py [--iterations N] [--json PATH]
"""
import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from fla.ops.kda import chunk_kda

SHAPES = {
    "primary": dict(h=8, t=1024, gated=False, segments=None),
    "secondary": dict(h=32, t=8192, gated=True, segments=None),
    "secondary-packed": dict(h=32, t=8192, gated=True, segments=25),
}
K = V = 128


def inputs(h, t, gated, segments):
    torch.manual_seed(0)
    dev, bf = "cuda", torch.bfloat16
    q = torch.randn(1, t, h, K, device=dev, dtype=bf)
    k = torch.randn(1, t, h, K, device=dev, dtype=bf)
    v = torch.randn(1, t, h, V, device=dev, dtype=bf)
    beta = torch.rand(1, t, h, device=dev, dtype=bf)
    kw = dict(scale=K ** -0.5, output_final_state=False)
    if gated:
        g = torch.randn(1, t, h, K, device=dev, dtype=bf)
        kw.update(
            use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True,
            lower_bound=-5.0,
            safe_gate=True,
            A_log=torch.randn(h, device=dev, dtype=torch.float32),
            dt_bias=torch.randn(h * K, device=dev, dtype=torch.float32),
        )
    else:
        g = F.logsigmoid(torch.randn(1, t, h, K, device=dev, dtype=torch.float32)).to(bf)
        q, k = F.normalize(q.float(), dim=-1).to(bf), F.normalize(k.float(), dim=-1).to(bf)
    if segments:
        edges = [round(i * t / segments) for i in range(segments + 1)]
        kw["cu_seqlens"] = torch.tensor(edges, device=dev, dtype=torch.long)
    return (q, k, v, g, beta), kw


def launches(call):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as p:
        call()
        torch.cuda.synchronize()
    return sum(1 for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def timed(call, iterations, clear=lambda: None):
    """Host wall-clock milliseconds of `iterations` calls after three warm-up ones, the launches
    of one and its peak device memory in MB."""
    for _ in range(3):  # autotuning and compiles, outside the timed part
        clear()
        call()
    torch.cuda.synchronize()
    times = []
    for _ in range(iterations):
        clear()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        call()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    clear()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    call()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / 1e6
    clear()
    return times, launches(call), peak


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--json")
    a = ap.parse_args()
    print(f"fla chunk_kda on {torch.cuda.get_device_name()} (torch {torch.__version__})")
    records = []
    for name, shape in SHAPES.items():
        args, kw = inputs(**shape)
        with torch.no_grad():
            times, n, peak = timed(lambda: chunk_kda(*args, **kw), a.iterations)
        report(records, name, "forward", times, n, peak)
        leaves = [x.requires_grad_(True) for x in args] + [
            kw[p].requires_grad_(True) for p in ("A_log", "dt_bias") if p in kw
        ]
        d_o = torch.randn_like(args[2])

        def step():
            o, _ = chunk_kda(*args, **kw)
            o.backward(d_o)

        def clear():
            for x in leaves:
                x.grad = None

        times, n, peak = timed(step, a.iterations, clear)
        report(records, name, "forward+backward", times, n, peak)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(records, f, indent=1)


def report(records, name, program, times, n, peak):
    med = statistics.median(times)
    print(f"{name}: fla {program} median {med:.3f} ms (min {min(times):.3f}, max {max(times):.3f}) over {len(times)} runs; {n} launches; peak {peak:.1f} MB")
    records.append(dict(shape=name, implementation="fla", program=program, times_ms=times, median_ms=med, launches=n, peak_mb=peak))


if __name__ == "__main__":
    main()
