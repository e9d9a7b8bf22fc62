"""``streamrl eval``: score saved policies on a recipe's held-out prompts, for a before/after table.

    streamrl eval models/tiny-word-problems runs/dataset-20261124-101500 --recipe recipes/dataset.toml

Each argument is a model folder (a transformers model) or a run folder (its ``policy/``; its own
``recipe.toml`` when ``--recipe`` is not given). All are scored on one cluster, one after the
other, exactly as ``[eval]`` scores a run (``extensions/evaluate.py``; the recipe's ``[eval]`` table,
or its defaults).
"""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from streamrl.cluster import lifecycle
from streamrl.errors import UserError
from streamrl.extensions import evaluate
from streamrl.extensions.evaluate import HeldOutEvaluation
from streamrl.run.controller import Controller
from streamrl.plugins.resolve import resolve
from streamrl.run.run_folder import RunFolder
from streamrl.recipe.recipe import EvalConfig, LoadedRecipe, load_recipe
from streamrl.telemetry.text import printable


def model_and_recipe(target: str, recipe: str | None, overrides: list[str]) -> tuple[Path, LoadedRecipe]:
    """The model folder ``target`` names and the recipe to score it with."""
    path = Path(target).resolve()
    if RunFolder.is_run(path):
        model = path / "policy"
        if not (model / "config.json").is_file():
            raise UserError(f"{target}: the run has no saved policy yet (policy/ is written when it completes)")
        if recipe is None:
            return model, RunFolder(path).recipe(overrides)
    elif (path / "config.json").is_file():
        model = path
    else:
        raise UserError(f"{target}: neither a model folder (config.json) nor a run folder (status.json, recipe.toml)")
    if recipe is None:
        raise UserError(f"{target}: a model folder needs --recipe (the task whose held-out prompts score it)")
    return model, load_recipe(recipe, overrides)


def score(targets: list[str], recipe: str | None, overrides: list[str], out: str | None) -> list[dict]:
    """Score every target; print the table, write JSON to ``out``; returns one row per target."""
    rows = []
    plan = [(t, *model_and_recipe(t, recipe, overrides)) for t in targets]  # every mistake before a cluster
    first = plan[0][2].recipe
    dask_cluster, client = lifecycle.start(first)
    try:
        pools = lifecycle.check_pools(client)
        for target, model, loaded in plan:
            if loaded.recipe.model is None:
                raise UserError(f"{target}: its recipe has no [model] table to put the policy in")
            r = loaded.recipe.model_copy(deep=True)
            r.model.path = str(model)
            r.eval = r.eval or EvalConfig()
            ctl = Controller(resolve(LoadedRecipe(r, loaded.file)), client, pools)
            ctl.place_residents()
            evaluator = ctl.extension(HeldOutEvaluation).evaluator  # (r.eval is set above)
            evaluator.submit(0)
            (result,) = evaluator.finish()
            for key in ("eval/policy_version", "eval/decoded_version_min", "eval/decoded_version_max"):
                result.pop(key, None)  # (one model, scored as it is: no versions to tell apart)
            rows.append({"model": target, **result})
    finally:
        lifecycle.stop(dask_cluster, client)
    show_scores(rows, out)
    return rows


def show_scores(rows: list[dict], out: str | None, console: Console | None = None) -> None:
    """Write ``rows`` as JSON to ``out`` (first: the scores are kept whatever the terminal does),
    then print them as a table on ``console``. A file that cannot be written is a
    :class:`UserError` naming it, after the table: the scores are shown either way."""
    failed = None
    if out:
        try:
            Path(out).write_text(json.dumps(rows, indent=2))
        except OSError as exc:
            failed = UserError(f"{out}: cannot write the scores ({exc.strerror or exc})")
    table = Table(title="held-out evaluation")
    keys = list(dict.fromkeys(k for row in rows for k in row if k != "model"))  # (targets may differ)
    # every cell a Text: a model's folder name (and an evaluation's error) is shown as written,
    # never read as rich markup
    for col in ["model", *keys]:
        table.add_column(Text(printable(col.removeprefix("eval/"))))
    for row in rows:
        table.add_row(Text(printable(str(row["model"]))),
                      *(Text(f"{row[k]:.3f}" if isinstance(row.get(k), float) else printable(str(row.get(k, ""))))
                        for k in keys))
    (console or Console()).print(table)
    if failed is not None:
        raise failed


__all__ = ["score", "show_scores", "model_and_recipe", "evaluate"]
