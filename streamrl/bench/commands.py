"""The ``streamrl bench`` commands: their arguments and which benchmark each runs (every
benchmark measures ratios within one invocation; ``docs/benchmarks.md`` holds the figures)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from streamrl.errors import UserError




def json_out(text: str) -> str:
    """A file a command writes its JSON result to at its end: checked before it runs (argparse
    says what is wrong in one line), so that minutes of measuring are not lost to a path that is a
    folder or cannot be written; its folder is made now when it does not exist yet. Returns the
    path with ``~`` expanded (the shell leaves ``--out=~/x.json`` as it is)."""
    import os

    path = Path(text).expanduser()
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder; expected a file to write")
    folder = path.parent
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(f"{text!r} cannot be written ({existing} is not a folder this user can "
                                         "write in)" if not path.exists() else f"{text!r} cannot be written")
    folder.mkdir(parents=True, exist_ok=True)
    return str(path)


def seconds(text: str) -> float:
    """A wait or a phase in seconds: a finite number above 0 and at most 1e6 (argparse says so in
    one line otherwise). Here, where ``cli/arguments.py``'s parsers find it too."""
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not (math.isfinite(value) and 0 < value <= 1e6):
        raise argparse.ArgumentTypeError(f"expected seconds above 0 and at most 1e6, got {text!r}")
    return value

def add_parsers(sub, recipe_args: Callable[[argparse.ArgumentParser], None]) -> None:
    """Add ``bench`` and its subcommands to the ``streamrl`` command's subparsers ``sub``;
    ``recipe_args`` adds a recipe file and its ``--set`` overrides to a parser."""
    bench = sub.add_parser("bench", help="benchmarks (ratios measured in one invocation)").add_subparsers(
        dest="cmd", required=True)
    modes = bench.add_parser("modes", help="the recipe in colocated, batch, stream and async mode")
    recipe_args(modes)
    modes.add_argument("--modes", default="colocated,batch,stream,async", help="comma-separated modes to run")
    modes.add_argument("--steps", type=int, default=5, help="measured steps per mode")
    modes.add_argument("--warmup", type=int, default=1, help="steps run first and left out of the figures")
    modes.add_argument("--out", default=None, type=json_out, help="write the JSON result here")
    early = bench.add_parser("stop-early", help="responses ended early by the reward's stop_early, and not")
    recipe_args(early)
    early.add_argument("--every", type=int, default=8, help="engine.stop_early_every of the variant that stops early")
    early.add_argument("--steps", type=int, default=5, help="measured steps per variant")
    early.add_argument("--warmup", type=int, default=1, help="steps run first and left out of the figures")
    early.add_argument("--out", default=None, type=json_out, help="write the JSON result here")
    skew = bench.add_parser("skew", help="fcfs vs the skew scheduler (oracle and learned ranker)")
    recipe_args(skew)
    skew.add_argument("--steps", type=int, default=5, help="measured steps per variant")
    skew.add_argument("--warmup", type=int, default=2, help="steps run first (the ranker learns) and left out")
    skew.add_argument("--out", default=None, type=json_out, help="write the JSON result here")
    skew.add_argument("--variants", default=None, metavar="NAME,NAME,...",
                      help="run only these variants (fcfs, the reference of every ratio, always runs); "
                           "default: every variant the recipe's task and engine allow")
    skew.add_argument("--repeats", type=int, default=1,
                      help="run every variant this many times, interleaved; the table shows medians and ranges")
    transfer = bench.add_parser("transfer", help="seconds and GB/s per weight publication, per transfer")
    recipe_args(transfer)
    transfer.add_argument("--transfers", default="dask", help="comma-separated transfer names")
    transfer.add_argument("--repeats", type=int, default=5, help="measured publications per transfer")
    transfer.add_argument("--out", default=None, type=json_out, help="write the JSON result here")
    engine = bench.add_parser("engine", help="generation per step: the recipe's engine, or variants of it")
    recipe_args(engine)
    engine.add_argument("--variant", dest="variants", action="append", default=[], metavar="LABEL:KEY=VALUE;...",
                        help='a variant of the recipe, e.g. --variant \'vllm:engine.name="vllm"\' (repeatable; '
                             "speed-ups are relative to the first)")
    engine.add_argument("--steps", type=int, default=5, help="measured steps per variant")
    engine.add_argument("--warmup", type=int, default=1, help="steps run first and left out of the figures")
    engine.add_argument("--out", default=None, type=json_out, help="write the JSON result here")
    trainer = bench.add_parser("trainer", help="the recipe's trainer on synthetic batches: tokens/s, MFU, peak memory")
    recipe_args(trainer)
    trainer.add_argument("--variant", dest="variants", action="append", default=[], metavar="LABEL:KEY=VALUE;...",
                         help="a variant of the recipe, e.g. --variant 'bf16:trainer.precision=\"bf16-autocast\"'")
    trainer.add_argument("--samples", type=int, default=64, help="samples per step")
    trainer.add_argument("--prompt-tokens", type=int, default=64, help="prompt tokens per sample")
    trainer.add_argument("--response-tokens", type=int, default=512, help="response tokens per sample")
    trainer.add_argument("--steps", type=int, default=3, help="measured optimizer steps")
    trainer.add_argument("--warmup", type=int, default=1, help="steps run first and left out")
    trainer.add_argument("--out", default=None, type=json_out, help="write the JSON result here")
    trainer.add_argument("--profile-dir", default=None,
                         help="profile one more step of each variant with torch.profiler; its operators by "
                              "device time go to DIR/trainer-profile-<variant>.txt")
    pool = bench.add_parser("trainpool", help="the train pool alone: one worker vs ddp vs fsdp over several "
                                              "(s/step, state and peak memory per rank)")
    recipe_args(pool)
    pool.add_argument("--variant", dest="variants", action="append", default=[], metavar="LABEL:KEY=VALUE;...",
                      help="a variant, e.g. --variant 'fsdp4:pools.train.workers=4;trainer.strategy=\"fsdp\"' "
                           "(default: one worker, ddp x2, fsdp x2)")
    pool.add_argument("--samples", type=int, default=64, help="samples per step")
    pool.add_argument("--prompt-tokens", type=int, default=16, help="prompt tokens per sample")
    pool.add_argument("--response-tokens", type=int, default=48, help="response tokens per sample")
    pool.add_argument("--steps", type=int, default=5, help="measured optimizer steps")
    pool.add_argument("--warmup", type=int, default=1, help="steps run first and left out")
    pool.add_argument("--out", default=None, type=json_out, help="write the JSON result here")
    elastic = bench.add_parser("elastic", help="a fixed generate pool (min, max workers) vs an elastic one")
    recipe_args(elastic)
    elastic.add_argument("--min", dest="lo", type=int, default=1, help="workers of the small fixed pool, where the "
                                                                      "elastic one starts")
    elastic.add_argument("--max", dest="hi", type=int, default=3, help="workers of the large fixed pool, the "
                                                                      "elastic one's ceiling")
    elastic.add_argument("--steps", type=int, default=10, help="measured steps per variant")
    elastic.add_argument("--warmup", type=int, default=1, help="steps run first and left out of the figures")
    elastic.add_argument("--repeats", type=int, default=1, help="passes of the three variants, interleaved; the "
                                                                 "median ratio to fixed-min is reported")
    elastic.add_argument("--out", default=None, type=json_out, help="write the JSON result here")
    bench_eval = bench.add_parser("eval", help="the recipe without and with [eval] every N steps: what evaluation "
                                               "costs training's samples/s")
    recipe_args(bench_eval)
    bench_eval.add_argument("--every", type=int, default=10, help="eval.every of the variant with evaluation")
    bench_eval.add_argument("--steps", type=int, default=30, help="measured steps per variant")
    bench_eval.add_argument("--warmup", type=int, default=3, help="steps run first and left out of the figures")
    bench_eval.add_argument("--repeats", type=int, default=1, help="passes of both variants, interleaved; the "
                                                                   "median ratio is reported")
    bench_eval.add_argument("--out", default=None, type=json_out, help="write the JSON result here")
    bench_learners = bench.add_parser("learners", help="several learners on one stream ([[learners]]) vs each "
                                                       "alone, back to back: wall time, generated tokens, rewards")
    recipe_args(bench_learners)
    bench_learners.add_argument("--learners", default="ppo,grpo,dpo",
                                help="comma-separated learners, each ALGORITHM (named after it) or NAME=ALGORITHM; "
                                     "the first is served")
    bench_learners.add_argument("--lora", type=int, default=None, metavar="RANK",
                                help="every learner a LoRA learner of this rank, and one more variant with the same "
                                     "learners training their whole weights (memory, publication bytes)")
    bench_learners.add_argument("--no-apart", dest="apart", action="store_false",
                                help="skip the runs of each learner alone")
    bench_learners.add_argument("--lora-lr", dest="lora_lr", type=float, default=None,
                                help="with --lora: the LoRA learners' trainer.lr (default: the recipe's)")
    bench_learners.add_argument("--no-eval", dest="add_eval", action="store_false",
                                help="a recipe without [eval] runs without it (no evaluation engine per learner)")
    bench_learners.add_argument("--no-full", dest="full", action="store_false",
                                help="with --lora: skip the variant of the same learners training their whole weights")
    bench_learners.add_argument("--shared-worker", dest="shared_worker", default=None, metavar="NAME",
                                help="every side learner on the one worker learner-NAME (LoRA learners there share "
                                     "one copy of the base weights)")
    bench_learners.add_argument("--set-learner", dest="set_learner", action="append", default=[],
                                metavar="NAME.KEY=VALUE", help="one learner's option in both variants, e.g. "
                                "dpo.trainer.lr=1e-4 or dpo.algorithm.beta=0.2 (repeatable)")
    bench_learners.add_argument("--steps", type=int, default=None, help="run.steps of every run (default: the "
                                                                        "recipe's)")
    bench_learners.add_argument("--out", default=None, type=json_out, help="write the JSON result here (default: "
                                                            "bench-learners.json beside the run folders)")
    stale = bench.add_parser("staleness", help="the recipe at staleness 0 (stream) to 8 (async), with and without "
                                               "an off-policy correction, over seeds: held-out score and samples/s")
    recipe_args(stale)
    stale.add_argument("--staleness", default="0,1,2,4,8", help="comma-separated staleness values (0: stream mode)")
    stale.add_argument("--corrections", default=None,
                       help="comma-separated algorithm.off_policy corrections (default: the default, none, and the "
                            "runner-up, m2po)")
    stale.add_argument("--seeds", type=int, default=3, help="runs per row, seeds 0..N-1")
    stale.add_argument("--steps", type=int, default=None, help="run.steps of every run (default: the recipe's)")
    stale.add_argument("--eval-prompts", type=int, default=256,
                       help="held-out prompts evaluated at the end when the recipe has no [eval]")
    stale.add_argument("--out", default=None, type=json_out, help="write the JSON result here")
    bench_serve = bench.add_parser("serve", help="the endpoint's latency under a bounded load, learning off vs on "
                                                 "(streamrl serve, openai clients on loopback)")
    recipe_args(bench_serve)
    bench_serve.add_argument("--clients", type=int, default=8, help="concurrent streaming clients")
    bench_serve.add_argument("--seconds", type=seconds, default=30, help="seconds of each phase")
    bench_serve.add_argument("--repeats", type=int, default=2, help="off/on pairs (the order alternates)")
    bench_serve.add_argument("--n", type=int, default=8, help="completions per request")
    bench_serve.add_argument("--client-processes", type=int, default=1,
                             help="processes the clients are spread over (one process's threads share its "
                                  "interpreter lock: on a GPU, 64 clients in one process measure themselves)")
    bench_serve.add_argument("--out", type=json_out, help="write the rows and ratios as JSON here")
    bench_serve.add_argument("--all-models", dest="all_models", action="store_true",
                             help="ask every model /v1/models lists in turn (each learner's variant too) and report "
                                  "each one's time to first token against the served policy's")


def run(args) -> int:
    """Run the benchmark ``args`` names; the exit status."""
    from streamrl.bench import engine, modes, skew, transfer

    if args.cmd == "transfer":
        if args.repeats < 1:
            raise UserError("--repeats must be >= 1")
        transfer.bench(args.file, args.overrides, [t.strip() for t in args.transfers.split(",") if t.strip()],
                       args.repeats, args.out)
        return 0
    if args.cmd == "stop-early":
        from streamrl.bench import stop_early

        if args.every < 1 or args.steps < 1 or args.warmup < 0:
            raise UserError("--every and --steps must be >= 1, --warmup >= 0")
        stop_early.bench(args.file, args.overrides, args.every, args.steps, args.warmup, args.out)
        return 0
    if args.cmd == "serve":
        from streamrl.bench import serve

        serve.bench(args.file, args.overrides, args.clients, args.seconds, args.repeats, args.n, args.out,
                    all_models=args.all_models, client_processes=args.client_processes)
        return 0
    if args.cmd == "staleness":
        from streamrl.bench import staleness

        try:
            values = [int(v) for v in args.staleness.split(",") if v.strip()]
        except ValueError:
            raise UserError(f"--staleness: expected whole numbers separated by commas, got {args.staleness!r}") from None
        if not values:
            raise UserError("--staleness: give at least one value")
        corrections = ([c.strip() for c in args.corrections.split(",") if c.strip()] if args.corrections
                       else [staleness.DEFAULT, staleness.RUNNER_UP])
        staleness.bench(args.file, args.overrides, values, corrections, args.seeds, args.steps, args.eval_prompts,
                        args.out)
        return 0
    if args.cmd == "learners":
        from streamrl.bench import learners

        learners.bench(args.file, args.overrides, [n.strip() for n in args.learners.split(",") if n.strip()],
                       args.set_learner, args.steps, args.out, lora=args.lora, apart=args.apart,
                       shared_worker=args.shared_worker, full=args.full, add_eval=args.add_eval,
                       lora_lr=args.lora_lr)
        return 0
    if args.steps < 1 or args.warmup < 0:
        raise UserError("--steps must be >= 1 and --warmup >= 0")
    if args.cmd == "trainer":
        from streamrl.bench import trainer

        if min(args.samples, args.prompt_tokens, args.response_tokens, args.steps) < 1 or args.warmup < 0:
            raise UserError("--samples, --prompt-tokens, --response-tokens and --steps must be >= 1, --warmup >= 0")
        trainer.bench(args.file, args.overrides, args.variants, args.samples, args.prompt_tokens,
                      args.response_tokens, args.steps, args.warmup, args.out, args.profile_dir)
        return 0
    if args.cmd == "trainpool":
        from streamrl.bench import trainpool

        if min(args.samples, args.prompt_tokens, args.response_tokens) < 1:
            raise UserError("--samples, --prompt-tokens and --response-tokens must be >= 1")
        trainpool.bench(args.file, args.overrides, args.variants, args.samples, args.prompt_tokens,
                        args.response_tokens, args.steps, args.warmup, args.out)
        return 0
    if args.cmd == "engine":
        engine.bench(args.file, args.overrides, args.variants, args.steps, args.warmup, args.out)
        return 0
    if args.cmd == "elastic":
        from streamrl.bench import elastic

        elastic.bench(args.file, args.overrides, args.lo, args.hi, args.steps, args.warmup, args.out,
                      repeats=args.repeats)
        return 0
    if args.cmd == "eval":
        from streamrl.bench import evaluation

        evaluation.bench(args.file, args.overrides, args.every, args.steps, args.warmup, args.repeats, args.out)
        return 0
    if args.cmd == "skew":
        skew.bench(args.file, args.overrides, args.steps, args.warmup, args.out, repeats=args.repeats,
                   only=args.variants)
        return 0
    chosen = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in chosen if m not in modes.MODES]
    if unknown:
        raise UserError(f"--modes: unknown mode {unknown[0]!r}; expected some of {', '.join(modes.MODES)}")
    modes.bench(args.file, args.overrides, chosen, args.steps, args.warmup, args.out)
    return 0


