"""How long a short run takes with its workers spawned and with them forked warm
(``cluster.worker_start``), side by side on one machine.

    python benchmarks/worker_start.py recipes/addition.toml --steps 2 --repeats 3

Makes the recipe's tiny model when ``--model`` is not given (``streamrl model init``, in a
temporary folder), then runs ``streamrl recipe run RECIPE`` ``--repeats`` times in each mode,
interleaved (spawn, warm, spawn, warm, ...), its output read to the end as a caller that waits
for it does. Each run's wall time and the CPU time the whole machine spent meanwhile (from
``/proc/stat``: the run's processes and the fork server are not all children that could be
waited for) are reported per mode, as medians, with the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def machine_cpu_s() -> float:
    """CPU seconds the machine has spent so far (user, nice, system, irq, softirq)."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    return sum(int(fields[i]) for i in (0, 1, 2, 5, 6)) / 100.0  # (USER_HZ is 100 on Linux)


def one_run(recipe: str, mode: str, steps: int, model: Path, out: Path, sets: list[str]) -> tuple[float, float]:
    """One ``streamrl recipe run``: its wall time and the machine's CPU time meanwhile."""
    args = [sys.executable, "-m", "streamrl", "recipe", "run", recipe, "--plain", "--no-report",
            "--set", f"run.steps={steps}", "--set", f'model.path="{model}"', "--set", "cluster.dashboard_port=0",
            "--set", f'run.out_dir="{out}"', "--set", f"cluster.worker_start={mode}"]
    for s in sets:
        args += ["--set", s]
    cpu0, t0 = machine_cpu_s(), time.perf_counter()
    proc = subprocess.run(args, capture_output=True, text=True)
    wall, cpu = time.perf_counter() - t0, machine_cpu_s() - cpu0
    if proc.returncode != 0:
        sys.exit(f"worker_start: the {mode} run failed:\n{proc.stderr[-3000:]}")
    return wall, cpu


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model", help="the model folder (default: a new tiny model for the recipe's task)")
    p.add_argument("--task", default="addition", help="the task of the tiny model made when --model is not given")
    p.add_argument("--set", dest="sets", action="append", default=[])
    a = p.parse_args()
    if a.repeats < 1:
        sys.exit("worker_start: --repeats must be at least 1")
    with tempfile.TemporaryDirectory(prefix="streamrl-worker-start-") as tmp:
        model = Path(a.model) if a.model else Path(tmp) / "model"
        if not a.model:
            subprocess.run([sys.executable, "-m", "streamrl", "model", "init", "--task", a.task, "--out", str(model),
                            "--warmstart-steps", "0"], check=True, capture_output=True)
        seen: dict[str, list[tuple[float, float]]] = {"spawn": [], "warm": []}
        for i in range(a.repeats):
            for mode in ("spawn", "warm") if i % 2 == 0 else ("warm", "spawn"):
                seen[mode].append(one_run(a.recipe, mode, a.steps, model, Path(tmp) / f"{mode}-{i}", a.sets))
                print(f"  {mode:5s} pass {i + 1}: {seen[mode][-1][0]:6.2f} s wall, {seen[mode][-1][1]:6.2f} s CPU",
                      flush=True)
    med = {m: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for m, v in seen.items()}
    print(f"\n{a.recipe}, {a.steps} steps, {a.repeats} runs each (medians):")
    print(f"  {'':6s} {'wall s':>8s} {'CPU s':>8s}")
    for m, (w, c) in med.items():
        print(f"  {m:6s} {w:8.2f} {c:8.2f}")
    print(f"  warm: {med['spawn'][0] / med['warm'][0]:.2f}x faster, {med['warm'][1] / med['spawn'][1]:.2f}x the CPU")


if __name__ == "__main__":
    main()
