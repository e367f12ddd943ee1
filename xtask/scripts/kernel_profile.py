#!/usr/bin/env python3
"""Per-kernel CPU profile of KDA programs on the PJRT CPU plugin (Linux, `perf`).

XLA's CPU backend JIT-compiles every fusion into anonymous executable memory that `perf`
cannot name. This script runs a command (normally `cargo xtask bench ...`) under `perf record`
with XLA's dumps on (`--xla_dump_to`, which writes each kernel's object file), snapshots the
process's anonymous executable mappings while it runs, finds each dumped kernel's code in the
snapshots, and attributes the samples to `module / kernel`. Samples in the plugin library
(matmuls and reductions run there, in XNNPACK/YNNPACK) are reported as one line.

Programs are told apart by when their code appeared: the mappings that appear together after
a pause belong to one compile, in the order XLA numbered the modules. Run with the compile
cache off (the script unsets KDA_COMPILE_CACHE) so that every program is compiled and dumped.

usage: kernel_profile.py [--top N] -- COMMAND...
example: python3 xtask/scripts/kernel_profile.py --top 25 -- \\
    target/release/xtask bench --suite forward --dtype f32 --iterations 400 --no-aot --no-markdown
"""
import argparse
import bisect
import collections
import glob
import os
import re
import subprocess
import sys
import tempfile
import time


def exec_regions(pid):
    """Anonymous executable mappings of `pid` as (start, end)."""
    out = []
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            p = line.split()
            if "x" in p[1] and len(p) < 6:
                a, b = p[0].split("-")
                out.append((int(a, 16), int(b, 16)))
    return out


def read_regions(pid, regions):
    data = {}
    with open(f"/proc/{pid}/mem", "rb") as mem:
        for a, b in regions:
            try:
                mem.seek(a)
                data[(a, b)] = mem.read(b - a)
            except OSError:
                pass
    return data


def kernel_code(obj):
    """The code bytes of one dumped kernel object (XLA puts them in `.ltext`)."""
    with tempfile.NamedTemporaryFile() as t:
        for sec in (".ltext", ".text"):
            subprocess.run(["objcopy", "-O", "binary", f"--only-section={sec}", obj, t.name], check=True)
            code = open(t.name, "rb").read()
            if code:
                return code
    return b""


def locate(code, blob, width=32):
    """Offsets in `blob` where `code` lies, voted by windows of `width` bytes (relocations differ)."""
    w = min(width, len(code))
    step = max(1, len(code) // 30)
    votes = collections.Counter()
    for s in range(0, max(1, len(code) - w + 1), step):
        i = blob.find(code[s : s + w])
        while i >= 0:
            votes[i - s] += 1
            i = blob.find(code[s : s + w], i + 1)
    if not votes:
        return []
    top = votes.most_common(1)[0][1]
    return [o for o, c in votes.items() if c >= max(2, top // 2)]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    cmd = [c for c in args.cmd if c != "--"] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        ap.error("give the command to profile after --")
    work = tempfile.mkdtemp(prefix="kda-prof-")
    dump, data = os.path.join(work, "xla"), os.path.join(work, "perf.data")
    env = dict(os.environ, XLA_FLAGS=f"--xla_dump_to={dump}", KDA_COMPILE_CACHE="")
    perf = subprocess.Popen(["perf", "record", "-F", "2000", "-o", data, "--"] + cmd, env=env)
    # Snapshot the new executable regions of the profiled process as they appear.
    pid, seen, groups, last_new = None, {}, [], None
    while perf.poll() is None:
        time.sleep(0.5)
        if pid is None:
            kids = subprocess.run(["pgrep", "-P", str(perf.pid)], capture_output=True, text=True).stdout.split()
            pid = int(kids[0]) if kids else None
            continue
        try:
            regions = exec_regions(pid)
        except OSError:
            continue
        new = [r for r in regions if r not in seen]
        if new:
            got = read_regions(pid, new)
            if last_new is None or time.time() - last_new > 1.5:
                groups.append([])
            groups[-1].extend(got.items())
            seen.update(got)
            last_new = time.time()
    # Kernels by module, in XLA's module order; module i's code is searched in group i.
    objs = collections.defaultdict(list)
    for o in glob.glob(os.path.join(dump, "*obj-file*.o")):
        m = re.match(r"(module_\d+)\..*obj-file\.(.*?)(_kernel_module)?\.o$", os.path.basename(o))
        if m:
            objs[m.group(1)].append((m.group(2), o))
    table = []
    for gi, module in enumerate(sorted(objs)):
        if gi >= len(groups):
            break
        for name, o in objs[module]:
            code = kernel_code(o)
            if not code:
                continue
            for (a, _b), blob in groups[gi]:
                for off in locate(code, blob):
                    table.append((a + off, a + off + len(code), f"{module} {name}"))
    table.sort()
    starts = [t[0] for t in table]
    script = subprocess.run(["perf", "script", "-i", data, "-F", "ip,dso"], capture_output=True, text=True).stdout
    counts, total = collections.Counter(), 0
    for line in script.splitlines():
        p = line.split()
        if len(p) < 2:
            continue
        total += 1
        ip, dso = int(p[0], 16), p[1]
        if "perf-" in dso or "JIT" in dso:
            i = bisect.bisect_right(starts, ip) - 1
            counts[table[i][2] if i >= 0 and ip < table[i][1] + 64 else "(JIT, not matched)"] += 1
        elif "pjrt" in dso or "plugin" in dso:
            counts["(plugin library: matmuls, reductions, runtime)"] += 1
        else:
            counts[dso.strip("()").split("/")[-1]] += 1
    print(f"{total} samples; HLO dumps in {dump}")
    for k, v in counts.most_common(args.top):
        print(f"{100.0 * v / max(total, 1):6.2f}%  {k}")
    return perf.returncode


if __name__ == "__main__":
    sys.exit(main())
