"""fla-core's chunk_kda forward at the benchmark shapes of docs/kda.md, timed on this GPU for the
device check (`cargo xtask gpu-check` stages and runs it beside `xtask gpu-bench`).

primary: H=8, T=1024, K=V=128, a pre-activated gate; secondary: H=32, T=8192 with the L2 norm and
the lower-bound gate (-5) in the kernel, safe_gate; secondary-packed: the same in 25 balanced
segments (cu_seqlens). bf16. Each shape's autotuning runs in warm-up calls outside the timed part,
so the timed calls use the configs it pinned; each timed call is a host wall-clock span ended by
torch.cuda.synchronize(). Kernel launches of one call are counted with torch.profiler.

usage: python3 fla_forward.py [--iterations N] [--json PATH]
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--json")
    a = ap.parse_args()
    print(f"fla chunk_kda forward on {torch.cuda.get_device_name()} (torch {torch.__version__})")
    records = []
    for name, shape in SHAPES.items():
        args, kw = inputs(**shape)
        call = lambda: chunk_kda(*args, **kw)  # noqa: E731
        with torch.no_grad():
            for _ in range(3):  # autotuning and compiles, outside the timed part
                call()
            torch.cuda.synchronize()
            times = []
            for _ in range(a.iterations):
                t0 = time.perf_counter()
                call()
                torch.cuda.synchronize()
                times.append((time.perf_counter() - t0) * 1e3)
            n = launches(call)
        med = statistics.median(times)
        print(f"{name}: fla forward median {med:.3f} ms (min {min(times):.3f}, max {max(times):.3f}) over {len(times)} runs; {n} launches")
        records.append(dict(shape=name, implementation="fla", times_ms=times, median_ms=med, launches=n))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
