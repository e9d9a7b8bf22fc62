"""Learning curves: reward vs wall time and vs samples, for recipes x modes x seeds.

    python benchmarks/learning_curves.py --recipes recipes/ppo.toml recipes/grpo.toml \\
        --modes stream async --seeds 0 1 2 --steps 120 --out docs/learning

Each run is ``streamrl recipe run`` (its own embedded cluster), one after another. Writes
``curves.json`` (every run's per-step reward, elapsed seconds and samples), ``table.md`` (final
reward: mean of the last 10 steps, per seed, with the mean and spread) and, when matplotlib is
installed (``pip install matplotlib``), ``curves.png``. ``async`` runs with ``max_staleness=1``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path


def run(recipe: str, mode: str, seed: int, steps: int, out: Path) -> dict:
    """One run; returns its curve."""
    folder = out / "runs" / f"{Path(recipe).stem}-{mode}-{seed}"
    args = [sys.executable, "-m", "streamrl", "recipe", "run", recipe, "--set", f"run.mode={mode}",
            "--set", "run.max_staleness=1", "--set", f"run.seed={seed}", "--set", f"run.steps={steps}",
            "--set", "cluster.dashboard_port=0", "--set", f'run.out_dir="{folder}"']
    subprocess.run(args, check=True, capture_output=True, text=True)
    (run_dir,) = folder.iterdir()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    t0 = records[0]["time"] - records[0]["step_s"]
    samples, curve = 0, []
    for r in records:
        samples += r["samples"]
        curve.append({"step": r["step"], "reward": r["reward_mean"], "seconds": r["time"] - t0, "samples": samples})
    return {"recipe": Path(recipe).stem, "mode": mode, "seed": seed, "curve": curve}


def final(curve: list[dict], k: int = 10) -> float:
    """Mean reward of the last ``k`` steps."""
    return sum(p["reward"] for p in curve[-k:]) / min(k, len(curve))


def table(runs: list[dict]) -> str:
    """Markdown: final reward per recipe and mode, per seed, mean and spread; seconds to run."""
    rows = ["| recipe | mode | final reward per seed | mean | spread (max-min) | first 10 steps | wall s (mean) |",
            "|---|---|---|---|---|---|---|"]
    keys = sorted({(r["recipe"], r["mode"]) for r in runs})
    for recipe, mode in keys:
        rs = sorted((r for r in runs if (r["recipe"], r["mode"]) == (recipe, mode)), key=lambda r: r["seed"])
        finals = [final(r["curve"]) for r in rs]
        first = statistics.mean(sum(p["reward"] for p in r["curve"][:10]) / 10 for r in rs)
        wall = statistics.mean(r["curve"][-1]["seconds"] for r in rs)
        rows.append(f"| {recipe} | {mode} | {', '.join(f'{x:.3f}' for x in finals)} | {statistics.mean(finals):.3f} "
                    f"| {max(finals) - min(finals):.3f} | {first:.3f} | {wall:.0f} |")
    return "\n".join(rows) + "\n"


def plot(runs: list[dict], path: Path) -> bool:
    """Reward vs wall time and vs samples (10-step moving average); False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = {}
    for r in runs:
        key = f"{r['recipe']} {r['mode']}"
        color = colors.setdefault(key, f"C{len(colors)}")
        rew = [p["reward"] for p in r["curve"]]
        smooth = [sum(rew[max(0, i - 9):i + 1]) / len(rew[max(0, i - 9):i + 1]) for i in range(len(rew))]
        label = key if r["seed"] == min(x["seed"] for x in runs) else None
        axes[0].plot([p["seconds"] for p in r["curve"]], smooth, color=color, alpha=0.8, label=label)
        axes[1].plot([p["samples"] for p in r["curve"]], smooth, color=color, alpha=0.8, label=label)
    for ax, x in zip(axes, ["wall seconds", "samples trained"]):
        ax.set_xlabel(x)
        ax.set_ylabel("reward (10-step mean)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("streamrl learning curves, 2 CPU cores (one line per seed)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipes", nargs="+", required=True)
    ap.add_argument("--modes", nargs="+", default=["stream", "async"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--out", default="docs/learning")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    for recipe in a.recipes:
        for mode in a.modes:
            for seed in a.seeds:
                runs.append(run(recipe, mode, seed, a.steps, out))
                print(f"{recipe} {mode} seed {seed}: final {final(runs[-1]['curve']):.3f}", flush=True)
                (out / "curves.json").write_text(json.dumps(runs))
    (out / "table.md").write_text(table(runs))
    print(table(runs))
    if plot(runs, out / "curves.png"):
        print(f"plot: {out / 'curves.png'}")


if __name__ == "__main__":
    main()
