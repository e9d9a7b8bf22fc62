"""What a run costs the machine: ``streamrl recipe run RECIPE`` in its own process, the CPU
seconds of it and of every process under it (its embedded cluster's scheduler, nannies, fork
server and workers), its wall time and its steady samples/s; for variants that differ only in
``DASK_*`` settings, interleaved.

    python benchmarks/run_cpu.py --steps 20 --repeats 3

The default variants are Dask's worker profiler as Dask sets it (every worker samples the
stack of each running task every 10 ms, for the dashboard's Profile page) and switched off
(``DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED=False``, as a user would). ``--variant
NAME:VAR=VALUE,...`` replaces them. Every process the run leaves behind is waited for: this
process is made their reaper (Linux ``PR_SET_CHILD_SUBREAPER``), so the children's CPU time it
reads holds all of them.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from display_cost import samples_per_s  # (the sibling script's: benchmarks/ is on the path of a script run from it)

PR_SET_CHILD_SUBREAPER = 36

VARIANTS = {
    "profiler-on": {},
    "profiler-off": {"DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED": "False"},
}


def children_cpu_s() -> float:
    """User + system CPU seconds of every child (and orphan) this process has waited for."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def reap_all(timeout: float) -> None:
    """Wait for every process left under this one (orphans come here as their reaper)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.1)
    raise RuntimeError(f"processes of the run still alive {timeout:g} s after it ended")


def one(recipe: str, steps: int, warmup: int, env: dict[str, str], out: Path) -> dict:
    """One run of ``recipe`` with ``env`` added: its CPU seconds (the whole tree), wall seconds and samples/s."""
    before = children_cpu_s()
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "streamrl", "recipe", "run", recipe, "--plain", "--no-report",
                           "--set", f"run.steps={steps}", "--set", f'run.out_dir="{out}"',
                           "--set", "cluster.dashboard=false"],
                          env={**os.environ, **env}, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    reap_all(60)
    if proc.returncode != 0:
        raise SystemExit(f"the run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    (run_dir,) = [p for p in out.iterdir() if p.is_dir()]
    return {"cpu_s": children_cpu_s() - before, "wall_s": wall, "samples_per_s": samples_per_s(run_dir, warmup)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default="recipes/ppo.toml")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2, help="steps left out of samples/s")
    ap.add_argument("--repeats", type=int, default=3, help="passes of every variant, interleaved")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:VAR=VALUE,...",
                    help="another variant (replaces the default ones when given)")
    ap.add_argument("--out", default=None, help="write the JSON result here")
    args = ap.parse_args()
    variants = VARIANTS
    if args.variant:
        variants = {}
        for spec in args.variant:
            name, _, settings = spec.partition(":")
            variants[name] = dict(item.split("=", 1) for item in settings.split(",") if item)
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise SystemExit("this benchmark needs Linux (PR_SET_CHILD_SUBREAPER)")
    root = Path(tempfile.mkdtemp(prefix="streamrl-run-cpu-"))
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    for i in range(args.repeats):
        for name, env in variants.items():
            out = root / f"{name}-{i}"
            out.mkdir()
            runs[name].append(one(args.recipe, args.steps, args.warmup, env, out))
            r = runs[name][-1]
            print(f"pass {i + 1} {name}: {r['cpu_s']:.1f} CPU-s, {r['wall_s']:.1f} s, "
                  f"{r['samples_per_s']:.1f} samples/s", flush=True)
    summary = {name: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for name, rs in runs.items()}
    print(f"\n{args.recipe}, {args.steps} steps, median of {args.repeats}:")
    print(f"{'variant':<22} {'CPU-s':>8} {'wall s':>8} {'samples/s':>10}")
    for name, m in summary.items():
        print(f"{name:<22} {m['cpu_s']:>8.1f} {m['wall_s']:>8.1f} {m['samples_per_s']:>10.1f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"recipe": args.recipe, "steps": args.steps, "runs": runs,
                                              "median": summary}, indent=2))


if __name__ == "__main__":
    main()
