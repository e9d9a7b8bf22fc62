"""``streamrl bench learners RECIPE``: several learners on one stream, against each alone.

    streamrl bench learners recipes/ppo.toml --learners ppo,grpo,dpo --steps 40 \\
        --set-learner dpo.trainer.lr=1e-4

Two variants of the recipe, run one after another in this process (each its own embedded
cluster, ``--set`` overrides applied to both):

- **together**: one ``[[learners]]`` table per name in ``--learners`` (the name is the learner's
  and its algorithm's; the first is served). A learner whose name is the recipe's
  ``[algorithm] name`` takes the recipe's ``[algorithm]`` options; any other gets a bare
  ``algorithm = {name = X}`` (options of one algorithm are unknown keys to another).
- **apart**: each learner alone, back to back: ``[algorithm] name = X`` (the recipe's options
  only for its own algorithm), no ``[[learners]]``.

``--set-learner NAME.trainer.KEY=V`` / ``NAME.algorithm.KEY=V`` set one learner's option in
both variants (its table's ``trainer``/``algorithm`` together, ``[trainer]``/``[algorithm]``
alone); ``NAME.queue`` and ``NAME.when_full`` only mean something together.

Figures: wall seconds of the run(s) (cluster start and stop included; apart: the sum),
generated tokens (``samples * response_len_mean`` summed over the records; together the
stream is counted once), and per learner the mean training reward of the last 10 steps and
the held-out reward (``[eval]``; added as ``every = 10`` when the recipe has none) at the first
and the newest evaluation in the records. Side learners train on the served policy's samples,
so their training reward is the stream's; and their evaluation after the last step is not in
``metrics.jsonl`` (it finishes after the last record), so their "last" is an earlier version
(``eval_last_version`` says which).
"""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from streamrl.api import hookimpl
from streamrl.bench.learner_variants import EVAL_EVERY, learner_overrides, parse_learners, variant_overrides
from streamrl.errors import UserError
from streamrl.recipe.recipe import load_recipe
from streamrl.run import runner

DEFAULT_LEARNERS = ("ppo", "grpo", "dpo")
#: Steps at the end whose training reward is averaged.
LAST_STEPS = 10
def generated_tokens(records: list[dict]) -> float:
    """Tokens the run generated for training: ``samples * response_len_mean`` over its records."""
    return sum(r.get("samples", 0) * r.get("response_len_mean", 0.0) for r in records)


def _evals(entries: list[dict]) -> dict:
    """First and newest held-out reward among ``entries`` (dicts with ``eval/*`` keys), by policy version."""
    seen = {}
    for e in entries:
        for ev in [e, *e.get("eval_unrecorded", [])]:
            if ev.get("eval/reward_mean") is not None and ev.get("eval/policy_version") is not None:
                seen[ev["eval/policy_version"]] = ev
    if not seen:
        return {"eval_first": None, "eval_last": None, "eval_first_version": None, "eval_last_version": None}
    lo, hi = min(seen), max(seen)
    return {"eval_first": seen[lo]["eval/reward_mean"], "eval_last": seen[hi]["eval/reward_mean"],
            "eval_first_version": lo, "eval_last_version": hi,
            "eval_pass@1_last": seen[hi].get("eval/pass@1")}


def _train_reward(values: list) -> float | None:
    values = [v for v in values if v is not None][-LAST_STEPS:]
    return sum(values) / len(values) if values else None


def summarize_alone(records: list[dict]) -> dict:
    """A learner alone: its run's figures."""
    return {"served": True, "steps_trained": len(records), "skipped_steps": 0,
            "train_reward": _train_reward([r.get("reward_mean") for r in records]), **_evals(records)}


def summarize_together(records: list[dict], names: list[str], final: dict | None = None) -> dict[str, dict]:
    """Each learner of the together run, from ``learners.<name>`` of the records and, for the side
    learners, ``final`` (the run folder's ``learners.json``: their state at the end, with the
    final evaluation, which lands after the last record)."""
    if len(names) == 1 and not any(r.get("learners") for r in records):  # (one learner: a plain run's records)
        return {names[0]: summarize_alone(records)}
    out = {}
    for name in names:
        mine = [r["learners"][name] for r in records if name in r.get("learners", {})]
        mine += [final[name]] if final and name in final else []
        last = mine[-1] if mine else {}
        served = bool(last.get("served"))
        # the served learner's evaluations are the record's own eval/* (also under learners.<name>)
        evals = _evals(records) if served else _evals(mine)
        out[name] = {"served": served, "state": last.get("state"), "algorithm": last.get("algorithm"),
                     "steps_trained": last.get("steps_trained"), "skipped_steps": last.get("skipped_steps", 0),
                     "train_reward": _train_reward([m.get("reward_mean") for m in mine]), **evals}
    return out


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


class WorkerMemory:
    """A plugin of the bench's own: after every step, each worker process's resident memory
    (RSS), the largest seen per worker kept -- what a learner costs its machine."""

    def __init__(self):
        self.peak_mb: dict[str, float] = {}

    @hookimpl
    def on_step_end(self, step, metrics):
        from distributed import default_client

        client = default_client()
        names = {a: str(w.get("name", a)) for a, w in client.scheduler_info()["workers"].items()}
        for address, rss in client.run(_rss).items():
            name = names.get(address, address)
            self.peak_mb[name] = max(self.peak_mb.get(name, 0.0), round(rss / 2**20, 1))


def _run(file: str, overrides: list[str], extra: list[str], label: str, console: Console) -> dict:
    """One run of the recipe with ``extra`` overrides: its folder, wall seconds, records, each
    worker's peak resident memory and what one publication weighs."""
    loaded = load_recipe(file, list(overrides) + list(extra) + ["cluster.dashboard=false",
                                                                 f'run.name="bench-learners-{label}"'])
    resolved = runner.resolve(loaded)
    memory = WorkerMemory()
    resolved.registry.pm.register(memory, name="bench-learners-memory")
    console.print(f"bench learners: {label} ({loaded.recipe.run.steps} steps)", markup=False)
    t0 = time.time()
    # (plain, no report: `streamrl report` on the run folders overlays them)
    run_dir = runner.run(loaded, console=Console(file=io.StringIO()), resolved=resolved, plain=True, report=False)
    wall = time.time() - t0
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    final = run_dir / "learners.json"
    steps = sorted(r["step_s"] for r in records[1:]) or [0.0]  # (the first step loads and compiles)
    return {"run_dir": str(run_dir), "wall_s": round(wall, 2), "steps": len(records),
            "generated_tokens": round(generated_tokens(records), 1), "records": records,
            "step_s_median": round(steps[len(steps) // 2], 3),
            "publish_bytes": max((r.get("publish_bytes", 0) for r in records), default=0),
            "weight_sync_s_median": round(sorted(r["weight_sync_s"] for r in records)[len(records) // 2], 4)
            if records else None,
            "worker_rss_mb": memory.peak_mb,
            "final": json.loads(final.read_text()) if final.exists() else {}}


def learner_memory(run: dict, names: list[str], shared_worker: str | None = None) -> dict[str, float | None]:
    """Each learner's peak resident memory in a run: the served one's train worker (``train-0``:
    the stream's first learner), a side learner's own worker (``learner-<name>``), or its share
    of the worker it shares with the other side learners (``learner-<shared_worker>``)."""
    rss = run["worker_rss_mb"]
    side = len(names) - 1
    out = {}
    for i, name in enumerate(names):
        if i == 0:
            out[name] = rss.get("train-0")
        elif shared_worker:
            total = rss.get(f"learner-{shared_worker}")
            out[name] = round(total / side, 1) if total is not None else None
        else:
            out[name] = rss.get(f"learner-{name}")
    return out


def bench(file: str, overrides: list[str], learners: list[str] = DEFAULT_LEARNERS, set_learner: list[str] = (),
          steps: int | None = None, out: str | None = None, console: Console | None = None,
          lora: int | None = None, apart: bool = True, shared_worker: str | None = None,
          full: bool = True, add_eval: bool = True, lora_lr: float | None = None) -> dict:
    """Run together, then each learner apart; print the table, write the JSON; returns the result.
    ``learners``: ``ALGORITHM`` or ``NAME=ALGORITHM`` items. ``lora``: every learner a LoRA
    learner of that rank (alpha twice it), and one more variant, **together-full**: the same
    learners training their whole weights, for memory and publication against it. ``apart``
    False: no runs of each learner alone; ``full`` False: no together-full variant. ``shared_worker``: every side learner trains on that one
    worker (LoRA learners there share one copy of the base weights). ``add_eval`` False: a
    recipe without ``[eval]`` is run without (each learner's evaluation engine is memory too).
    ``lora_lr``: the LoRA learners' ``trainer.lr`` (an adapter wants a larger one than the whole
    weights do; default the recipe's)."""
    console = console or Console(width=120)
    learners, algorithms = parse_learners(list(learners))
    if steps is not None and steps < 1:
        raise UserError("--steps must be >= 1")
    if lora is not None and lora < 1:
        raise UserError("--lora must be a rank >= 1")
    base = load_recipe(file, overrides).recipe
    add_eval = add_eval and base.eval is None
    algorithm = {"name": base.algorithm.name, **base.algorithm.options()}
    per = learner_overrides(list(set_learner), learners)
    for name in learners[1:] if shared_worker else []:
        per[name]["table"].setdefault("worker", shared_worker)
    adapter = {"lora": {"rank": lora, "alpha": 2.0 * lora}, **({"lr": lora_lr} if lora_lr else {})} if lora else None
    extra = variant_overrides(algorithm, learners, per, add_eval, steps, algorithms, adapter)
    whole = variant_overrides(algorithm, learners, per, add_eval, steps, algorithms)["together"] if lora and full \
        else None
    variants = [("together", extra["together"])] + ([("together-full", whole)] if whole else [])
    if apart:
        variants += [(f"{n} alone", ov) for n, ov in extra["apart"].items()]
    # every variant validated before any runs: a learner's bad option is one line, not a failed run later
    for label, ov in variants:
        try:
            runner.resolve(load_recipe(file, list(overrides) + ov))
        except UserError as exc:
            raise UserError(f"bench learners, {label}: {exc}") from None
    if add_eval:
        console.print(f"bench learners: {file} has no [eval]; both variants get [eval] every = {EVAL_EVERY}",
                      markup=False)

    def together_run(label: str, ov: list[str]) -> dict:
        run = _run(file, overrides, ov, label, console)
        run["learners"] = summarize_together(run.pop("records"), learners, run.pop("final"))
        for name, mb in learner_memory(run, learners, shared_worker).items():
            run["learners"][name]["rss_mb"] = mb
        return run

    together = together_run("together", extra["together"])
    result_variants = {"together": together}
    if whole:
        result_variants["together-full"] = together_run("together-full", whole)
    runs = {}
    for name in learners if apart else []:
        run = _run(file, overrides, extra["apart"][name], name, console)
        run["learner"] = summarize_alone(run.pop("records"))
        run["learner"]["rss_mb"] = learner_memory(run, [name])[name]
        runs[name] = run
    apart_wall = sum(r["wall_s"] for r in runs.values())
    apart_tokens = sum(r["generated_tokens"] for r in runs.values())
    if apart:
        result_variants["apart"] = {"wall_s": round(apart_wall, 2), "generated_tokens": round(apart_tokens, 1),
                                    "runs": runs}
    ratios = {
        "wall_together_over_apart": together["wall_s"] / apart_wall if apart_wall else None,
        "tokens_together_over_apart": together["generated_tokens"] / apart_tokens if apart_tokens else None,
    }
    if whole:
        f = result_variants["together-full"]
        ratios["publish_bytes_ratio"] = together["publish_bytes"] / f["publish_bytes"] if f["publish_bytes"] else None
        ratios["step_s_lora_over_full"] = together["step_s_median"] / f["step_s_median"] if f["step_s_median"] else None
        mine = [lr["rss_mb"] for lr in together["learners"].values() if lr["rss_mb"]]
        theirs = [lr["rss_mb"] for lr in f["learners"].values() if lr["rss_mb"]]
        ratios["rss_per_learner_lora_over_full"] = (sum(mine) / len(mine)) / (sum(theirs) / len(theirs)) \
            if mine and theirs else None
    result = {
        "recipe": str(file), "overrides": list(overrides), "learners": learners, "algorithms": algorithms,
        "set_learner": list(set_learner), "lora_rank": lora, "lora_lr": lora_lr, "shared_worker": shared_worker,
        "steps": steps or base.run.steps, "eval_added": add_eval,
        "variants": result_variants, "ratios": ratios,
    }
    console.print(table(result))
    labels = {"wall_together_over_apart": "wall together / apart", "tokens_together_over_apart": "tokens together / apart",
              "publish_bytes_ratio": "publish bytes LoRA / full", "step_s_lora_over_full": "step s LoRA / full",
              "rss_per_learner_lora_over_full": "rss per learner LoRA / full"}
    console.print("   ".join(f"{labels[k]}: {_num(v, '.3f')}" for k, v in ratios.items()))
    path = Path(out) if out else Path(together["run_dir"]).parent / "bench-learners.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    console.print(f"result: {path}", markup=False)
    return result


def _num(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def table(result: dict) -> Table:
    """Every variant, a row per learner."""
    rank = f", LoRA rank {result['lora_rank']}" if result.get("lora_rank") else ""
    t = Table(title=escape(f"streamrl bench learners {result['recipe']} ({result['steps']} steps{rank}"
                           f"{f', [eval] every = {EVAL_EVERY} added' if result['eval_added'] else ''})"),
              caption=f"train reward: mean of the last {LAST_STEPS} steps (a side learner's is the stream's); "
                      "eval: held-out reward at the first and the newest evaluation recorded, v = policy version; "
                      "rss: the learner's worker's peak resident memory; publish: bytes of one publication "
                      "of the served learner")
    for col in ("variant", "learner", "wall s", "step s", "gen tokens", "publish", "rss MB", "trained", "skipped",
                "train reward", "eval first", "eval last", "eval v"):
        t.add_column(col, justify="left" if col in ("variant", "learner") else "right", no_wrap=col == "learner")
    v = result["variants"]

    def row(variant: str, name: str, run: dict | None, lr: dict, together: bool = False) -> None:
        versions = f"{lr['eval_first_version']}->{lr['eval_last_version']}" if lr["eval_first"] is not None else "-"
        t.add_row(variant, name + (" (served)" if together and lr.get("served") else ""),
                  f"{run['wall_s']:.1f}" if run else "", f"{run['step_s_median']:.2f}" if run else "",
                  f"{run['generated_tokens']:,.0f}" if run else "",
                  f"{run['publish_bytes']:,}" if run else "", _num(lr.get("rss_mb"), ".0f"),
                  str(lr.get("steps_trained", "-")), str(lr.get("skipped_steps", 0)),
                  _num(lr["train_reward"], ".3f"), _num(lr["eval_first"], ".3f"), _num(lr["eval_last"], ".3f"),
                  versions)

    for label in ("together", "together-full"):
        if label in v:
            for i, name in enumerate(result["learners"]):
                row(label if i == 0 else "", name, v[label] if i == 0 else None, v[label]["learners"][name],
                    together=True)
    if "apart" in v:
        for i, name in enumerate(result["learners"]):
            run = v["apart"]["runs"][name]
            row("apart" if i == 0 else "", name, run, run["learner"])
        t.add_row("apart, sum", "", f"{v['apart']['wall_s']:.1f}", "", f"{v['apart']['generated_tokens']:,.0f}",
                  *[""] * 8)
    return t
