"""The two variants of ``streamrl bench learners``, written as recipe overrides: the learners
named on the command line (``--learners``), one learner's own options (``--set-learner``), and
the ``--set`` lines of "together" (one ``[[learners]]`` table per name) and "apart" (each alone)."""

from __future__ import annotations

import json
import math

from streamrl.errors import UserError
from streamrl.recipe.recipe import parse_override

#: ``[eval] every`` added to both variants when the recipe has no ``[eval]``.
EVAL_EVERY = 10
#: Keys of a ``[[learners]]`` table that ``--set-learner`` may set besides ``trainer.*`` and ``algorithm.*``.
TABLE_KEYS = ("queue", "when_full", "nice", "worker")


def toml_value(value) -> str:
    """``value`` as one-line TOML (an inline table for a dict), for a ``--set`` override."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))} = {toml_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise UserError(f"cannot write {value!r} ({type(value).__name__}) as a recipe value")


def learner_overrides(items: list[str], learners: list[str]) -> dict[str, dict]:
    """``--set-learner NAME.key=value`` items as ``{name: {"trainer": {...}, "algorithm": {...},
    "table": {...}}}``; one line for a learner not in ``learners`` or a key a table has not."""
    out = {name: {"trainer": {}, "algorithm": {}, "table": {}} for name in learners}
    for item in items:
        keys, value = parse_override(item)
        name, rest = keys[0], keys[1:]
        if name not in out:
            raise UserError(f"--set-learner {item!r}: {name!r} is not in --learners ({', '.join(learners)})")
        if len(rest) >= 2 and rest[0] in ("trainer", "algorithm"):
            node = out[name][rest[0]]
            for k in rest[1:-1]:
                node = node.setdefault(k, {})
            node[rest[-1]] = value
        elif len(rest) == 1 and rest[0] in TABLE_KEYS:
            out[name]["table"][rest[0]] = value
        elif rest == ["algorithm", "name"] or rest == ["algorithm"] or rest == ["name"]:
            raise UserError(f"--set-learner {item!r}: the learner's name is its algorithm; pick it in --learners")
        else:
            raise UserError(f"--set-learner {item!r}: expected NAME.trainer.KEY=V, NAME.algorithm.KEY=V, "
                            f"NAME.queue=N, NAME.when_full=skip|pace, NAME.nice=N or NAME.worker=W")
    for name, o in out.items():
        if "name" in o["algorithm"]:
            raise UserError(f"--set-learner {name}.algorithm.name: the learner's name is its algorithm; "
                            "pick it in --learners")
    return out


def parse_learners(items: list[str]) -> tuple[list[str], dict[str, str]]:
    """``--learners`` items -- ``ALGORITHM`` (a learner named after its algorithm) or
    ``NAME=ALGORITHM`` (several learners of one algorithm) -- as the names and each name's algorithm."""
    names, algorithms = [], {}
    for item in items:
        name, _, algorithm = item.partition("=")
        name, algorithm = name.strip(), (algorithm.strip() or name.strip())
        names.append(name)
        algorithms[name] = algorithm
    return names, algorithms


def variant_overrides(algorithm: dict, learners: list[str], per_learner: dict[str, dict] | None = None,
                      add_eval: bool = False, steps: int | None = None, algorithms: dict[str, str] | None = None,
                      trainer: dict | None = None) -> dict:
    """The extra ``--set`` overrides of both variants, from the recipe's ``[algorithm]`` table
    (``{"name": ..., **options}``) and the learners' names (the first served; ``algorithms``:
    each name's algorithm, default the name itself): ``{"together": [...], "apart": {name:
    [...]}}``. ``per_learner``: from :func:`learner_overrides`; ``add_eval``: the recipe has no
    ``[eval]``; ``steps``: run.steps; ``trainer``: trainer options of every learner (``lora``)."""
    if not learners:
        raise UserError("--learners: name at least one learner")
    again = sorted({n for n in learners if learners.count(n) > 1})
    if again:
        raise UserError(f"--learners: {again[0]!r} is named twice")
    per_learner = per_learner or {}
    algorithms = algorithms or {}
    own = algorithm["name"]
    options = {k: v for k, v in algorithm.items() if k != "name"}
    common = ([f"eval.every={EVAL_EVERY}"] if add_eval else []) + ([f"run.steps={steps}"] if steps else [])
    tables, apart = [], {}
    for name in learners:
        algo = algorithms.get(name, name)
        o = per_learner.get(name) or {"trainer": {}, "algorithm": {}, "table": {}}
        table = {"name": name}
        if algo != own or o["algorithm"]:  # the recipe's own algorithm with no changes: omitted, its [algorithm]
            table["algorithm"] = {"name": algo, **(options if algo == own else {}), **o["algorithm"]}
        if o["trainer"] or trainer:
            table["trainer"] = {**(trainer or {}), **o["trainer"]}
        table.update(o["table"])
        tables.append(table)
        alone = [f"algorithm={toml_value({'name': algo, **(options if algo == own else {})})}", "learners=[]",
                 'run.serve=""']
        alone += [f"trainer.{k}={toml_value(v)}" for k, v in (trainer or {}).items()]
        alone += [f"algorithm.{k}={toml_value(v)}" for k, v in o["algorithm"].items()]
        alone += [f"trainer.{k}={toml_value(v)}" for k, v in o["trainer"].items()]
        apart[name] = common + alone
    together = common + [f"learners={toml_value(tables)}", f"run.serve={toml_value(learners[0])}"]
    return {"together": together, "apart": apart}
