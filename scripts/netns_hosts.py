"""Hosts of their own: a recipe on a hand-started Dask cluster whose scheduler, generate site,
train site and reward worker each live in their own network namespace, with a rate-capped link
between the generate and the train site.

Needs root (network namespaces, ``tc``) and iproute2 with ``htb``; not part of the test suite.
From the repository root:

    sudo .venv/bin/python scripts/netns_hosts.py                      # W1, both transfers, 4 rates
    sudo .venv/bin/python scripts/netns_hosts.py --rates none,100mbit --transfers dask \\
        --relay both --generate-workers 2 --steps 4

The layout (one kernel, so the processes still share this machine's CPUs):

    srl-switch   a bridge; every other namespace has one veth pair into it
    srl-sched    10.77.0.1  dask scheduler, and the ``streamrl recipe run`` client
    srl-gen      10.77.0.2  dask workers generate-0 .. generate-{N-1}  (the generate site)
    srl-train    10.77.0.3  dask worker train-0                        (the train site)
    srl-reward   10.77.0.4  dask worker reward-0

The processes are started with ``ip netns exec`` exactly as docs/deploy.md ("A cluster started by
hand") says, and the recipe (``recipes/addition.toml`` by default) runs with
``--set cluster.address=tcp://10.77.0.1:8786``. The generate site <-> train site link is capped
with an ``htb`` class on each side's veth (only packets addressed to the other site; the
scheduler and reward traffic stay unshaped). For each rate, transfer and relay setting it runs
the recipe for ``--steps`` steps and reads ``metrics.jsonl``: samples/s and ``weight_sync_s``
(optimizer step done -> every engine holds the new weights; ``run.mode = stream``, where a step
waits for its weights, so that number is the whole publication) over the steps after the first
(which opens the connections). The model is the W1 addition model's tokenizer with a larger
random Llama (``--hidden``, ``--layers``): weights large enough for the link to matter, small
enough for two cores to train a step in seconds.

Namespaces and processes are removed on exit, on Ctrl-C and on failure; namespaces named
``srl-*`` left by a killed run are removed at the start.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent  # dask and streamrl of this environment
NET = "10.77.0"
SWITCH = "srl-switch"
#: namespace -> last octet of its address
HOSTS = {"srl-sched": 1, "srl-gen": 2, "srl-train": 3, "srl-reward": 4}
SCHEDULER = f"tcp://{NET}.1:8786"


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run a command, failing loudly with its stderr."""
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {proc.stderr.strip()}")
    return proc


def namespaces() -> list[str]:
    """Namespaces of this script (``srl-*``) that exist now."""
    out = sh("ip", "netns", "list").stdout.split("\n")
    return [line.split()[0] for line in out if line.startswith("srl-")]


def teardown_net() -> None:
    """Kill what still runs inside our namespaces, then delete them (veths and bridge go along)."""
    for ns in namespaces():
        for pid in sh("ip", "netns", "pids", ns, check=False).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        sh("ip", "netns", "del", ns, check=False)


def setup_net() -> None:
    """The switch namespace with a bridge, and one namespace per host joined to it."""
    teardown_net()  # leftovers of a killed run
    sh("ip", "netns", "add", SWITCH)
    sh("ip", "-n", SWITCH, "link", "add", "br0", "type", "bridge")
    sh("ip", "-n", SWITCH, "link", "set", "br0", "up")
    for ns, octet in HOSTS.items():
        sh("ip", "netns", "add", ns)
        port = f"p{octet}"
        sh("ip", "link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", port, "netns", SWITCH)
        sh("ip", "-n", SWITCH, "link", "set", port, "master", "br0", "up")
        sh("ip", "-n", ns, "addr", "add", f"{NET}.{octet}/24", "dev", "eth0")
        sh("ip", "-n", ns, "link", "set", "eth0", "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")


def cap(rate: str | None) -> None:
    """Cap the generate site <-> train site link at ``rate`` (tc syntax, e.g. ``100mbit``) in
    both directions; None: no cap. Other traffic is unclassified, which htb sends unshaped."""
    for ns, peer in (("srl-gen", "srl-train"), ("srl-train", "srl-gen")):
        sh("tc", "-n", ns, "qdisc", "del", "dev", "eth0", "root", check=False)
        if rate is None:
            continue
        bits = parse_rate(rate)
        burst = str(max(64 * 1024, int(bits / 8 / 100)))  # 10 ms at the rate: veths send 64 KiB GSO frames
        sh("tc", "-n", ns, "qdisc", "add", "dev", "eth0", "root", "handle", "1:", "htb", "default", "99")
        sh("tc", "-n", ns, "class", "add", "dev", "eth0", "parent", "1:", "classid", "1:10", "htb",
           "rate", rate, "ceil", rate, "burst", burst, "cburst", burst)
        sh("tc", "-n", ns, "filter", "add", "dev", "eth0", "protocol", "ip", "parent", "1:", "prio", "1",
           "u32", "match", "ip", "dst", f"{NET}.{HOSTS[peer]}/32", "flowid", "1:10")


def parse_rate(rate: str) -> float:
    """Bits per second of a tc rate such as ``100mbit`` or ``1gbit``."""
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1.0}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * scale
    raise ValueError(f"rate {rate!r}: expected e.g. 1gbit, 100mbit")


class Processes:
    """The Dask processes, each in its own session so it is killed with its children."""

    def __init__(self, logs: Path):
        self.procs: list[subprocess.Popen] = []
        self.logs = logs

    def start(self, ns: str, name: str, cmd: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        """``ip netns exec <ns> <cmd>``, output to ``<logs>/<name>.log``."""
        log = open(self.logs / f"{name}.log", "w")
        proc = subprocess.Popen(["ip", "netns", "exec", ns, *cmd], stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, **(env or {})}, start_new_session=True, cwd=ROOT)
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        """SIGTERM every process group, then SIGKILL what is left after 10 s."""
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.time() + 10
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        self.procs.clear()


def start_cluster(procs: Processes, generate_workers: int, generate_threads: int) -> None:
    """Scheduler and workers as docs/deploy.md starts them by hand; waits until all are up."""
    dask = str(BIN / "dask")
    procs.start("srl-sched", "scheduler", [dask, "scheduler", "--host", f"{NET}.1", "--port", "8786",
                                           "--preload", "streamrl.telemetry.dashboard"])
    # the embedded cluster's malloc setting and device, as docs/deploy.md gives them
    env = {"MALLOC_MMAP_THRESHOLD_": "33554432", "STREAMRL_DEVICE": "cpu"}
    workers = [("srl-gen", f"generate-{i}", generate_threads, "generate") for i in range(generate_workers)]
    workers += [("srl-train", "train-0", 1, "train"), ("srl-reward", "reward-0", 2, "reward")]
    for ns, name, threads, pool in workers:
        procs.start(ns, name, [dask, "worker", SCHEDULER, "--name", name, "--nthreads", str(threads),
                               "--resources", f"{pool}={threads}"], env=env)
    wait_for_workers(len(workers))


def wait_for_workers(n: int, timeout: float = 120.0) -> None:
    """Block until the scheduler lists ``n`` workers (asked from the scheduler's namespace)."""
    probe = ("import sys; from distributed import Client; c = Client(sys.argv[1], timeout=10); "
             f"c.wait_for_workers({n}, timeout={timeout}); "
             "print({i['name']: a for a, i in c.scheduler_info(n_workers=-1)['workers'].items()}); c.close()")
    proc = sh("ip", "netns", "exec", "srl-sched", sys.executable, "-c", probe, SCHEDULER, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"the workers did not come up: {proc.stderr.strip()[-2000:]}")
    print("cluster:", proc.stdout.strip(), flush=True)


def make_model(out: Path, hidden: int, layers: int) -> int:
    """The W1 addition tokenizer with a random Llama of ``hidden`` x ``layers``; returns its
    parameter count (made once, reused when ``out`` exists)."""
    marker = out / "streamrl_netns.json"
    if marker.exists():
        return json.loads(marker.read_text())["parameters"]
    from transformers import AutoConfig, AutoTokenizer

    from streamrl.run.model_init import init_model
    from streamrl.tasks.tiny import save, tiny_llama

    init_model("addition", str(out), warmstart_steps=0, seed=0)  # tokenizer and context length
    tokenizer = AutoTokenizer.from_pretrained(out)
    positions = AutoConfig.from_pretrained(out).max_position_embeddings
    model = tiny_llama(len(tokenizer), hidden=hidden, layers=layers, heads=hidden // 64, max_positions=positions)
    save(model, tokenizer, out)
    params = sum(p.numel() for p in model.parameters())
    marker.write_text(json.dumps({"parameters": params, "hidden": hidden, "layers": layers}))
    return params


def run_recipe(recipe: str, model: Path, out: Path, label: str, transfer: str, relay: bool, steps: int,
               extra: list[str], timeout: float, wire_dtype: str = "as_trained") -> dict:
    """``streamrl recipe run`` from the scheduler's namespace; the steps' mean numbers."""
    options = f'name="{transfer}"'
    if transfer == "dask":  # (options of the dask transfer only)
        options += f', relay={str(relay).lower()}, wire_dtype="{wire_dtype}"'
    section = "{" + options + "}"
    sets = [f"cluster.address={SCHEDULER}", f"model.path={model}", f"run.out_dir={out}", f"run.name={label}",
            f"run.steps={steps}", f"transfer={section}", *extra]
    cmd = [str(BIN / "streamrl"), "recipe", "run", recipe, "--no-report"]
    for s in sets:
        cmd += ["--set", s]
    t0 = time.time()
    proc = subprocess.run(["ip", "netns", "exec", "srl-sched", *cmd], capture_output=True, text=True,
                          cwd=ROOT, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{label}: streamrl exited {proc.returncode}: {proc.stderr.strip()[-3000:]}")
    run_dir = max(out.glob(f"{label}-*"), key=lambda p: p.stat().st_mtime)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    later = [r for r in records if r["step"] >= 1] or records  # step 0 opens the connections
    samples = sum(r["samples"] for r in later)
    return {"samples_per_s": samples / sum(r["step_s"] for r in later),
            "sync_s": sum(r["weight_sync_s"] for r in later) / len(later),
            "step_s": sum(r["step_s"] for r in later) / len(later), "steps": len(later),
            "wall_s": time.time() - t0, "run_dir": str(run_dir)}


def knee(rows: list[dict], rates: list[str]) -> dict[tuple[str, bool], str]:
    """Per (transfer, relay): the highest rate whose samples/s is under 90% of the uncapped run's."""
    out = {}
    for key in {(r["transfer"], r["relay"]) for r in rows}:
        mine = {r["rate"]: r["samples_per_s"] for r in rows if (r["transfer"], r["relay"]) == key}
        base = mine.get("none")
        below = [rate for rate in rates if rate != "none" and base and rate in mine and mine[rate] < 0.9 * base]
        out[key] = ("? (no uncapped run)" if base is None else max(below, key=parse_rate) if below
                    else "none of these")
    return out


def table(rows: list[dict], rates: list[str], params: int, model_mb: float) -> str:
    """The results as a Markdown table, and where throughput falls under 90%."""
    lines = [f"model: {params / 1e6:.1f} M parameters, {model_mb:.0f} MB of fp32 weights per publication", "",
             "| link cap | transfer | relay | samples/s | sync s/step | step s | vs uncapped |",
             "|---|---|---|---|---|---|---|"]
    base = {(r["transfer"], r["relay"]): r["samples_per_s"] for r in rows if r["rate"] == "none"}
    for r in rows:
        b = base.get((r["transfer"], r["relay"]))
        share = f"{r['samples_per_s'] / b:.0%}" if b else "-"
        lines.append(f"| {r['rate']} | {r['transfer']} | {'yes' if r['relay'] else 'no'} | {r['samples_per_s']:.2f} | "
                     f"{r['sync_s']:.2f} | {r['step_s']:.2f} | {share} |")
    lines.append("")
    for (transfer, relay), rate in sorted(knee(rows, rates).items()):
        lines.append(f"{transfer}{' + relay' if relay else ''}: under 90% of uncapped samples/s from {rate} down")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="recipes/addition.toml")
    p.add_argument("--rates", default="none,1gbit,300mbit,100mbit", help="tc rates; none = uncapped")
    p.add_argument("--transfers", default="dask,torch_distributed")
    p.add_argument("--relay", choices=["no", "yes", "both"], default="no",
                   help="the dask transfer's relay (ignored for other transfers)")
    p.add_argument("--wire-dtype", choices=["as_trained", "bfloat16"], default="as_trained",
                   help="the dask transfer's wire_dtype")
    p.add_argument("--generate-workers", type=int, default=2)
    p.add_argument("--generate-threads", type=int, default=16)
    p.add_argument("--steps", type=int, default=4, help="steps per run (the first is not counted)")
    p.add_argument("--hidden", type=int, default=640)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--workdir", default="/tmp/streamrl-netns", help="model, run folders, process logs")
    p.add_argument("--set", dest="extra", action="append", default=[],
                   help="more recipe overrides (after the script's own)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one run may take")
    p.add_argument("--out", help="write the rows as JSON here")
    args = p.parse_args()
    if os.geteuid() != 0:
        print("netns_hosts.py needs root (ip netns, tc)", file=sys.stderr)
        return 2
    work = Path(args.workdir)
    (work / "logs").mkdir(parents=True, exist_ok=True)
    model = work / f"addition-h{args.hidden}-l{args.layers}"
    params = make_model(model, args.hidden, args.layers)
    # stream: a step waits for its weights, so weight_sync_s is the whole publication; W1's batch
    # shape shrunk to what two shared cores train in seconds at this model size
    extra = ["run.mode=stream", "trainer.prompts_per_step=16", "trainer.samples_per_prompt=4",
             "pools.generate.groups_per_task=4", "run.checkpoint_every=0", *args.extra]
    rates = [r.strip() for r in args.rates.split(",")]
    relays = {"no": [False], "yes": [True], "both": [False, True]}[args.relay]
    procs = Processes(work / "logs")

    def interrupted(signum, frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, interrupted)
    rows = []
    try:
        setup_net()
        start_cluster(procs, args.generate_workers, args.generate_threads)
        for rate in rates:
            cap(None if rate == "none" else rate)
            for transfer in args.transfers.split(","):
                for relay in relays if transfer == "dask" else [False]:
                    label = f"{transfer}-{rate}-{'relay' if relay else 'direct'}"
                    wire = args.wire_dtype if transfer == "dask" else "as_trained"
                    if wire != "as_trained":
                        label += f"-{wire}"
                    r = run_recipe(args.recipe, model, work / "runs", label, transfer, relay, args.steps, extra,
                                   args.timeout, wire)
                    rows.append({"rate": rate, "transfer": transfer + ("" if wire == "as_trained" else f" ({wire})"),
                                 "relay": relay, **r})
                    print(f"{label}: {r['samples_per_s']:.2f} samples/s, sync {r['sync_s']:.2f} s/step, "
                          f"step {r['step_s']:.2f} s ({r['wall_s']:.0f} s)", flush=True)
    except KeyboardInterrupt:
        print("interrupted; cleaning up", file=sys.stderr)
        return 130
    finally:
        procs.stop()
        teardown_net()
        if args.out and rows:
            Path(args.out).write_text(json.dumps(rows, indent=2))
    print()
    print(table(rows, rates, params, params * 4 / 1e6))
    return 0


if __name__ == "__main__":
    sys.exit(main())
