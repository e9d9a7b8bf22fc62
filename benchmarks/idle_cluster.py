"""What an idle Dask cluster costs: a ``dask scheduler`` and one ``dask worker`` (its nanny and
the worker process) started by hand on loopback, left alone, their CPU time read from
``/proc`` over a window; with Dask's own watcher rates and with the ones streamrl's clusters
use (``cluster/pool_workers.WATCHERS``, given as ``DASK_*`` variables as docs/deploy.md does),
interleaved.

    python benchmarks/idle_cluster.py --window 20 --repeats 3

A streamrl run's processes idle much of their time (waiting on a step, on traffic to serve, on
a learner), and a cluster someone started stays up between runs, so what they spend doing
nothing is spent all along. Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from streamrl.cluster.pool_workers import WATCHERS, dask_environment


def cpu_s(root: int) -> float:
    """CPU seconds (user + system) spent so far by ``root`` and every process below it."""
    parent, spent = {}, {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:  # (ended meanwhile)
                continue
            parent[int(entry.name)] = int(fields[1])
            spent[int(entry.name)] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    tree, grew = {root}, True
    while grew:
        below = {pid for pid, pp in parent.items() if pp in tree} - tree
        tree |= below
        grew = bool(below)
    return sum(spent.get(pid, 0.0) for pid in tree)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one(env: dict[str, str], settle: float, window: float) -> float:
    """CPU seconds an idle scheduler and worker spend in ``window`` seconds, ``settle`` s after their start."""
    dask = shutil.which("dask", path=str(Path(sys.executable).parent)) or "dask"
    environ = {**os.environ, **env, "OMP_NUM_THREADS": "1"}
    port = free_port()
    procs = [subprocess.Popen([dask, "scheduler", "--host", "127.0.0.1", "--port", str(port), "--no-dashboard"],
                              env=environ, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)]
    procs.append(subprocess.Popen([dask, "worker", f"tcp://127.0.0.1:{port}", "--host", "127.0.0.1", "--nthreads", "1",
                                   "--no-dashboard"], env=environ, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, start_new_session=True))
    try:
        time.sleep(settle)
        before = sum(cpu_s(p.pid) for p in procs)
        time.sleep(window)
        return sum(cpu_s(p.pid) for p in procs) - before
    finally:
        for p in procs:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def main() -> None:
    """Measure both rates, interleaved, and print the medians and their ratio."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--window", type=float, default=20.0, help="seconds measured per cluster")
    ap.add_argument("--settle", type=float, default=12.0, help="seconds after the start before measuring")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    modes = {"Dask's rates": {}, "streamrl's rates": dask_environment(WATCHERS)}
    print("streamrl's:", " ".join(f"{k}={v}" for k, v in modes["streamrl's rates"].items()))
    seen: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(args.repeats):
        for mode, env in modes.items():
            seen[mode].append(one(env, args.settle, args.window))
            print(f"  {mode}: {seen[mode][-1]:.2f} CPU-s in {args.window:.0f} s", flush=True)
    medians = {m: statistics.median(v) for m, v in seen.items()}
    for mode, m in medians.items():
        print(f"{mode:18s} median {m:.2f} CPU-s per {args.window:.0f} s ({100 * m / args.window:.1f}% of a core)")
    a, b = medians.values()
    print(f"streamrl's / Dask's: {b / a:.2f}x the CPU")


if __name__ == "__main__":
    main()
