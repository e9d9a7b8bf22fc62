"""How long a short run takes with its workers spawned and with them forked warm
(``cluster.worker_start``), side by side on one machine; or this checkout's run against another
checkout's (``--against``), to measure a change of the code.

    python benchmarks/worker_start.py recipes/addition.toml --steps 2 --repeats 3
    python benchmarks/worker_start.py recipes/addition.toml --against ../before --report
    python benchmarks/worker_start.py recipes/addition.toml --against ../before --command validate
    python benchmarks/worker_start.py recipes/addition.toml --against ../before --this-set cluster.dashboard=false

``--against DIR`` names a checkout with its own virtualenv (``DIR/.venv``; e.g. ``git worktree
add ../before COMMIT`` and ``pip install -e`` there): both sides then run with the recipe's own
``worker_start``, this checkout's with this Python. ``--command validate`` times ``streamrl recipe
validate`` instead of a run: what every command pays before it does anything.

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


def one_run(python: str, cwd: Path, recipe: str, mode: str | None, steps: int, model: Path, out: Path,
            sets: list[str], report: bool, command: str) -> tuple[float, float]:
    """One ``streamrl recipe run`` (or ``validate``): its wall time and the machine's CPU time
    meanwhile. ``mode``: the ``cluster.worker_start`` to set, or None for the recipe's own."""
    args = [python, "-m", "streamrl", "recipe", command, recipe,
            "--set", f"run.steps={steps}", "--set", f'model.path="{model}"', "--set", "cluster.dashboard_port=0",
            "--set", f'run.out_dir="{out}"']
    if command == "run":
        args += ["--plain"] + ([] if report else ["--no-report"])
    if mode is not None:
        args += ["--set", f"cluster.worker_start={mode}"]
    for s in sets:
        args += ["--set", s]
    cpu0, t0 = machine_cpu_s(), time.perf_counter()
    proc = subprocess.run(args, capture_output=True, text=True, cwd=cwd)
    wall, cpu = time.perf_counter() - t0, machine_cpu_s() - cpu0
    if proc.returncode != 0:
        sys.exit(f"worker_start: the {mode or python} {command} failed:\n{proc.stderr[-3000:]}")
    return wall, cpu


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model", help="the model folder (default: a new tiny model for the recipe's task)")
    p.add_argument("--task", default="addition", help="the task of the tiny model made when --model is not given")
    p.add_argument("--set", dest="sets", action="append", default=[])
    p.add_argument("--this-set", dest="this_sets", action="append", default=[],
                   help="a --set for this checkout's runs only (a setting the other checkout does not have)")
    p.add_argument("--against", type=Path, help="another checkout with its own .venv: compare its runs with this one's")
    p.add_argument("--report", action="store_true", help="write each run's report (default: --no-report)")
    p.add_argument("--command", choices=["run", "validate"], default="run")
    a = p.parse_args()
    if a.repeats < 1:
        sys.exit("worker_start: --repeats must be at least 1")
    here = Path(__file__).resolve().parent.parent
    recipe = str(Path(a.recipe).resolve())
    if a.against is not None:
        other = a.against.resolve() / ".venv" / "bin" / "python"
        if not other.is_file():
            sys.exit(f"worker_start: --against {a.against}: no virtualenv at {other.parent.parent}")
        # (label, python, checkout, worker_start, settings of its own)
        sides = [("this", sys.executable, here, None, a.this_sets), ("against", str(other), a.against.resolve(), None, [])]
    else:
        sides = [("spawn", sys.executable, here, "spawn", a.this_sets), ("warm", sys.executable, here, "warm", a.this_sets)]
    with tempfile.TemporaryDirectory(prefix="streamrl-worker-start-") as tmp:
        model = Path(a.model) if a.model else Path(tmp) / "model"
        if not a.model:
            subprocess.run([sys.executable, "-m", "streamrl", "model", "init", "--task", a.task, "--out", str(model),
                            "--warmstart-steps", "0"], check=True, capture_output=True)
        seen: dict[str, list[tuple[float, float]]] = {label: [] for label, *_ in sides}
        for i in range(a.repeats):
            for label, python, cwd, mode, own in sides if i % 2 == 0 else sides[::-1]:
                seen[label].append(one_run(python, cwd, recipe, mode, a.steps, model, Path(tmp) / f"{label}-{i}",
                                           [*a.sets, *own], a.report, a.command))
                print(f"  {label:7s} pass {i + 1}: {seen[label][-1][0]:6.2f} s wall, {seen[label][-1][1]:6.2f} s CPU",
                      flush=True)
    med = {m: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for m, v in seen.items()}
    what = f"recipe {a.command}" + (", reports written" if a.report and a.command == "run" else "")
    print(f"\n{a.recipe}, {what}, {a.steps} steps, {a.repeats} each (medians):")
    print(f"  {'':7s} {'wall s':>8s} {'CPU s':>8s}")
    for m, (w, c) in med.items():
        print(f"  {m:7s} {w:8.2f} {c:8.2f}")
    (base, *_), (new, *_) = sides if a.against is None else sides[::-1]
    print(f"  {new}: {med[base][0] / med[new][0]:.2f}x faster, {med[new][1] / med[base][1]:.2f}x the CPU of {base}")


if __name__ == "__main__":
    main()
