"""Running a shipped recipe with the vllm engine the way a user runs it, and what every run's
records must show; shared by the recipe tests (two files, so that the plugin's two test processes share them out)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def run(tmp_path, recipe: str, *overrides: str) -> list[dict]:
    """Run ``recipe`` with ``overrides``; the run's metrics records."""
    args = [sys.executable, "-m", "streamrl", "recipe", "run", recipe, "--set", f'run.out_dir="{tmp_path}"',
            "--set", "cluster.dashboard_port=0"]
    for o in overrides:
        args += ["--set", o]
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    (run_dir,) = tmp_path.iterdir()
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def check_every_sample_trained_once(records, prompts: int, n: int):
    """Each step trained every sample of its ``prompts`` x ``n`` once, none trained twice, and
    each sample's staleness is its step less the policy version that generated it."""
    seen = set()
    for r in records:
        uids = [x["uid"] for x in r["sample_log"]]
        assert sorted(uids) == sorted(f"{r['step']}-{i:03d}-{k}" for i in range(prompts) for k in range(n)), r["step"]
        assert not seen & set(uids)
        seen |= set(uids)
        for x in r["sample_log"]:
            assert x["staleness"] == r["step"] - x["version"]
