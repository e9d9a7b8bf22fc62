"""What the speed of a split depends on, per device: a :class:`StageProfile`.

Generation: one engine instance per generate device, decode steps costing
``c0 + per_context_token * total context`` (the affine model the skew scheduler already fits),
prefill per prompt token, a KV cache of ``kv_capacity_tokens``. Training: device-seconds per
token (split evenly over the training devices: data parallel), device-seconds per optimizer
step, seconds to load a new policy on an instance. Lengths: the output lengths of observed
groups, which the predictor resamples.

A profile comes from the recipe itself when its engine is a cost model (``sim``: exact, and
the observed groups are the first steps' lengths the task's length model draws), or from a
short warm-up run of the recipe on its own cluster (any engine: its decode-latency fit, the
trainer's measured seconds per token, the lengths it produced). Saved as JSON, it can be
planned with again without running anything (``streamrl plan --profile FILE``).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from streamrl.sim.capabilities import SimEngineCapabilities, SimTrainerCapabilities


class Group(BaseModel):
    """One observed prompt group."""

    model_config = ConfigDict(extra="forbid")
    prompt_tokens: int = Field(ge=0)
    lengths: list[Annotated[int, Field(ge=0)]] = Field(min_length=1)
    """Each sample's output tokens (0: an empty response, ended at once)."""


class StageProfile(BaseModel):
    """Per-device costs of a recipe's stages and its observed output lengths."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, allow_inf_nan=False)
    source: str
    """How the profile was obtained (``sim cost model`` or ``measured: ...``)."""
    simulated: bool = False
    """True when every time in it is simulated (a ``sim`` recipe)."""
    decode_c0_s: float = Field(ge=0)
    """Fixed seconds of one decode step of an instance."""
    decode_per_context_token_s: float = Field(ge=0)
    """Seconds one decode step adds per token of context in the running batch."""
    prefill_per_token_s: float = Field(0.0, ge=0)
    """Seconds to prefill one prompt token."""
    kv_capacity_tokens: int = Field(1 << 40, ge=1)
    """Context tokens an instance's KV cache holds; admission stops when full."""
    max_running: int = Field(0, ge=0)
    """Most requests decoding at once on an instance (0: only the KV cache limits)."""
    train_per_token_s: float = Field(ge=0)
    """Device-seconds of forward + backward per token (prompt + response)."""
    optimizer_step_s: float = Field(0.0, ge=0)
    """Device-seconds of one optimizer step."""
    weight_sync_s: float = Field(0.0, ge=0)
    """Seconds an instance stops decoding to load a new policy."""
    step_overhead_s: float = Field(0.0, ge=0)
    """Controller seconds per step between a step's end and the next step's admission
    (metrics, bookkeeping; measured by a calibration run)."""
    submit_per_group_s: float = Field(0.0, ge=0)
    """Controller seconds to submit one prompt group's generate and reward tasks (measured)."""
    prompts_per_step: int = Field(ge=1)
    samples_per_prompt: int = Field(ge=1)
    groups: list[Group] = Field(min_length=1)
    """Observed groups; predictions draw each step's groups from them."""

    def draw_steps(self, steps: int, seed: int) -> list[list[Group]]:
        """``steps`` steps of ``prompts_per_step`` groups drawn (with replacement) from the
        observed ones: the predictor's workload."""
        rng = random.Random(seed)
        return [[rng.choice(self.groups) for _ in range(self.prompts_per_step)] for _ in range(steps)]

    def save(self, path: str | Path) -> Path:
        """Write the profile as JSON."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.model_dump_json(indent=1))
        return path

    @classmethod
    def read(cls, path: str | Path) -> StageProfile:
        """A profile written by :meth:`save` (one-line error for a bad file)."""
        try:
            return cls.model_validate(json.loads(Path(path).read_text()))
        except (OSError, ValueError) as exc:
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise ValueError(f"profile {path}: not a streamrl plan profile ({first})") from None


def from_cost_model(resolved, observe_steps: int = 4) -> StageProfile | None:
    """The exact profile of a recipe whose engine is the ``sim`` cost model (None otherwise).
    Its observed groups are the first ``observe_steps`` steps' lengths as the sim engine will
    draw them: what a warm-up of that many steps would observe."""
    from streamrl.sim import latency
    from streamrl.sim.workload import sample_length

    e = resolved.engine.capabilities()
    if not isinstance(e, SimEngineCapabilities):
        return None
    g = e.profile  # the generating device
    trainer = resolved.trainer.capabilities()
    tr = (trainer.device if isinstance(trainer, SimTrainerCapabilities) else None) or g  # the training device
    t = resolved.recipe.trainer
    task = resolved.task.build()
    groups = []
    for step in range(observe_steps):
        for prompt in task.prompts(step, t.prompts_per_step):
            lengths = [sample_length(prompt, random.Random(f"{e.seed}-{prompt.uid}-{k}"))
                       for k in range(t.samples_per_prompt)]
            groups.append(Group(prompt_tokens=prompt.answer["prompt_tokens"], lengths=lengths))
    c0, per_ctx = latency.decode_coefficients(g)
    return StageProfile(
        source=f"sim cost model ({observe_steps} steps of lengths)", simulated=True,
        decode_c0_s=c0, decode_per_context_token_s=per_ctx,
        prefill_per_token_s=latency.prefill_time(g, 1), kv_capacity_tokens=e.kv_capacity_tokens,
        max_running=e.max_running, train_per_token_s=latency.train_time(tr, 1, 1),
        optimizer_step_s=tr.params * 16 / (tr.mem_bw * tr.bw_eff), weight_sync_s=latency.weight_sync_time(g),
        prompts_per_step=t.prompts_per_step, samples_per_prompt=t.samples_per_prompt, groups=groups)


def calibrate(file: str, overrides: list[str], steps: int = 3) -> dict:
    """The controller's own costs on this machine, from a short run of the recipe in ``async``
    mode at its own split: ``{"step_overhead_s", "submit_per_group_s"}`` in real seconds, the
    medians over the steps after the first. A cluster of many processes on few cores makes
    them large (on 2 cores with 12 workers: ~0.2 s per step, ~2 ms per group), and a simulated
    recipe scales them by ``1 / time_scale``: they are part of what its runs measure."""
    import io

    from rich.console import Console

    from streamrl.bench.variants import run_variants  # (runs need the cluster; a profile alone does not)

    rows = run_variants(file, overrides, {"calibrate": ["run.mode=async"]}, steps, 1,
                        Console(file=io.StringIO()), "calibrate", None)
    records = [json.loads(line) for line in
               (Path(rows["calibrate"]["run_dir"]) / "metrics.jsonl").read_text().splitlines()][1:steps + 1]
    return {**controller_costs(records), "run_dir": rows["calibrate"]["run_dir"]}


def controller_costs(records: list[dict]) -> dict:
    """``{"step_overhead_s", "submit_per_group_s"}``: the medians over a run's step records of
    the controller's time outside task submission, and of its submission time per group."""
    import statistics

    per_group = [r["submit_s"] / r["submitted_groups"] for r in records if r["submitted_groups"]]
    return {"step_overhead_s": statistics.median(max(0.0, r["controller_s"] - r["submit_s"]) for r in records),
            "submit_per_group_s": statistics.median(per_group) if per_group else 0.0}


def from_warmup(file: str, overrides: list[str], resolved, steps: int = 3) -> StageProfile:
    """The profile of a recipe with a real engine, measured on this machine.

    Decoding: an engine is built here, alone, and its own start-up profile (the decode-latency
    fit the skew scheduler uses) gives ``c0`` and the per-context-token slope. Everything else
    comes from ``steps`` steps of the recipe in ``batch`` mode at its own split (after one
    warm-up step): batch mode trains only once generation is done, so a step's ``train_s`` is
    the train pool's time alone, and its seconds per token times the train workers are the
    device-seconds per token; the weight loads' time; the controller's own costs (as
    :func:`calibrate`); and every group's prompt and output lengths, which predictions resample.
    Not measured: prefill (folded into the decode steps' cost) and the optimizer step apart from
    the tokens (folded into the per-token cost)."""
    import io
    import statistics

    from rich.console import Console

    from streamrl.errors import UserError
    from streamrl.flow.placement import build_engine
    from streamrl.plugins.resolve import Chosen
    from streamrl.bench.variants import run_variants

    chosen = resolved.engine
    if isinstance(getattr(chosen.config, "profile", None), bool):  # a run without a scheduler leaves it off
        chosen = Chosen(chosen.component, chosen.config.model_copy(update={"profile": True}))
    engine = build_engine(chosen, resolved.model_path)
    try:
        latency = engine.decode_latency()
    finally:
        engine.close()
    if latency is None:
        raise UserError(f"{file}: engine {resolved.recipe.engine.name!r} measured no decode-latency profile at start-up "
                        "(engine.profile = false?); turn it on or give a saved profile with --profile")
    c0 = float(latency(0.0))
    per_ctx = max(0.0, (float(latency(4096.0)) - c0) / 4096.0)
    rows = run_variants(file, overrides, {"warm-up": ["run.mode=batch"]}, steps, 1, Console(file=io.StringIO()),
                        "plan warm-up", None)
    run_dir = Path(rows["warm-up"]["run_dir"])
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][1:steps + 1]
    train_workers = resolved.recipe.pools.train.workers

    def tokens(r) -> int:
        return sum(x["prompt_len"] + x["response_len"] for x in r["sample_log"])

    seen: dict[str, tuple[int, list[int]]] = {}  # group -> (prompt tokens, its samples' lengths)
    for r in records:
        for x in r["sample_log"]:
            seen.setdefault(f'{r["step"]}/{x["uid"].rsplit("-", 1)[0]}', (x["prompt_len"], []))[1].append(x["response_len"])
    groups = {key: Group(prompt_tokens=prompt, lengths=lengths) for key, (prompt, lengths) in seen.items()}
    t = resolved.recipe.trainer
    engine = resolved.engine.capabilities()
    return StageProfile(
        source=f"measured: engine start-up profile + {len(records)} batch steps of the recipe ({run_dir.name})",
        decode_c0_s=c0, decode_per_context_token_s=per_ctx,
        kv_capacity_tokens=engine.kv_capacity_tokens or 1 << 40, max_running=engine.max_running,
        train_per_token_s=statistics.median(r["train_s"] / max(tokens(r), 1) for r in records) * train_workers,
        weight_sync_s=statistics.median(r["weight_sync_s"] for r in records), **controller_costs(records),
        prompts_per_step=t.prompts_per_step, samples_per_prompt=t.samples_per_prompt, groups=list(groups.values()))
