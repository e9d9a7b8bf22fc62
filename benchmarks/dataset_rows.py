"""What the ``dataset`` task's rows cost the run's process: read from ``datasets``' table when
asked for (how the task keeps them) against copied whole as Python dicts (how it kept them
before).

    python benchmarks/dataset_rows.py --rows 300000 --out x.json

Writes a verl-layout parquet of ``--rows`` rows (a chat prompt of about ``--chars`` characters,
a ground truth, ``extra_info``) into a temporary folder, then builds the task on it in a fresh
process for each way, ``--repeats`` times, interleaved: the process's memory after the build
against before it (the libraries imported): its own memory (``RssAnon``) and all it has
resident (``VmRSS``, which also counts the pages of datasets' memory-mapped cache file that the
build read, and which the kernel takes back when it needs them), the build's seconds, and the seconds of
handing out one step's ``--per-step`` prompts. datasets' cache of the file is made once, before
the first build, so neither way pays the conversion.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ONE = r"""
import json, sys, time
import datasets, transformers  # (imported before the first measure: the libraries are not the rows)
from streamrl.tasks import dataset
from streamrl.tasks.dataset import DatasetConfig, DatasetTask


class Whole(list):
    '''The rows as a list of dicts (``Dataset.to_list()``), as the task held them before.'''

    def take(self, kept):
        return Whole(self[i] for i in kept)


def rss_mb(kind="RssAnon"):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(kind + ":")) / 1024


path, way, per_step, tokenizer = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
if way == "whole":
    lazy = dataset.load_rows
    dataset.load_rows = lambda *a: Whole(lazy(*a).table.to_list())
before, before_all = rss_mb(), rss_mb("VmRSS")
t0 = time.perf_counter()
task = DatasetTask(DatasetConfig(path=path, seed=1, model_path=tokenizer))
built = time.perf_counter() - t0
t0 = time.perf_counter()
task.prompts(3, per_step)
step = time.perf_counter() - t0
print(json.dumps({"way": way, "anon_mb": rss_mb() - before, "rss_mb": rss_mb("VmRSS") - before_all, "build_s": built,
                  "step_s": step, "rows": len(task)}))
"""


def write(path: Path, rows: int, chars: int) -> None:
    """A verl-layout parquet of ``rows`` rows, each prompt about ``chars`` characters."""
    import pandas as pd

    filler = ("Think step by step and give the final answer after '####'. " * (chars // 60 + 1))[:chars]
    pd.DataFrame({
        "data_source": ["arith"] * rows,
        "prompt": [[{"role": "user", "content": f"{filler} What is {i} + {i % 97}?"}] for i in range(rows)],
        "ability": ["math"] * rows,
        "reward_model": [{"style": "rule", "ground_truth": str(i + i % 97)} for i in range(rows)],
        "extra_info": [{"split": "train", "index": i} for i in range(rows)],
    }).to_parquet(path)


def main() -> None:
    """Run it; see the module docstring."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=300_000)
    ap.add_argument("--chars", type=int, default=400)
    ap.add_argument("--per-step", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "data.parquet"
        write(path, args.rows, args.chars)
        import string

        from streamrl.tasks.tiny import char_tokenizer

        tokenizer = Path(tmp) / "tokenizer"  # (a character tokenizer with a chat template: the model's own)
        char_tokenizer(string.printable).save_pretrained(tokenizer)
        env = {**os.environ, "HF_DATASETS_CACHE": str(Path(tmp) / "cache")}  # (its own cache, gone after)
        subprocess.run([sys.executable, "-c", f"import datasets; datasets.load_dataset('parquet', "
                        f"data_files={str(path)!r}, split='train')"], env=env, capture_output=True, check=True)
        results = []
        for k in range(args.repeats):
            for way in ("lazy", "whole") if k % 2 == 0 else ("whole", "lazy"):
                out = subprocess.run([sys.executable, "-c", ONE, str(path), way, str(args.per_step), str(tokenizer)],
                                     capture_output=True, text=True, env=env)
                if out.returncode:
                    raise SystemExit(f"the {way} build failed:\n{out.stderr[-3000:]}")
                results.append(json.loads(out.stdout.strip().splitlines()[-1]))
                print(results[-1], flush=True)
    summary = {}
    for way in ("lazy", "whole"):
        mine = [r for r in results if r["way"] == way]
        summary[way] = {key: min(r[key] for r in mine) for key in ("anon_mb", "rss_mb", "build_s", "step_s")}
    summary["anon_ratio_whole_to_lazy"] = summary["whole"]["anon_mb"] / max(summary["lazy"]["anon_mb"], 1.0)
    report = {"rows": args.rows, "chars": args.chars, "per_step": args.per_step, "runs": results, "best": summary}
    print(json.dumps(summary, indent=1))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
