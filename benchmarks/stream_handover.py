"""The hand-over of each decode step's tokens to served requests, alone: what it costs the host
per token, the two ways a server can be woken, in one run.

    python benchmarks/stream_handover.py --slots 256 --max-new-tokens 256 --steps 200

A real :class:`~streamrl.engines.slot_decoder.SlotDecoder` (a 2-layer Qwen2-shaped model made
here, on CPU) holds ``--slots`` followed requests; each "step" moves every request's token count
on by one (no decoding: this measures what surrounds the step) and calls the engine's
:class:`~streamrl.engines.slot_streams.TokenStreams` ``emit``, whose callbacks hand the tokens to
an asyncio event loop in another thread, where one task per request takes them from its queue,
as the endpoint's streams do. Two ways of waking that loop, alternating over ``--rounds``:

- ``per-choice``: each callback calls ``call_soon_threadsafe`` (one self-pipe write per choice
  per step, as the endpoint did before);
- ``batched``: each callback posts to the endpoint's :class:`~streamrl.serve.completion.Inbox`
  without waking, and ``emit`` calls its ``flush`` once after the step's callbacks.

Per way: microseconds of the step thread per token (wall, ``emit`` alone), and CPU microseconds
of the whole process per token (both threads). On a GPU a decode step of 256 slots takes ~3 ms:
a hand-over of 4 ms a step would be the pace of every served token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import threading
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from streamrl.engines.slot_decoder import SlotDecoder
from streamrl.engines.slot_requests import Request
from streamrl.engines.slot_streams import TokenStreams
from streamrl.serve.completion import Inbox


class Server:
    """An event loop in its own thread with one consumer task per request."""

    def __init__(self, requests: int):
        self.loop = asyncio.new_event_loop()
        self.inbox = Inbox(self.loop)
        self.taken = 0
        ready = threading.Event()

        async def consume(queue):
            while True:
                tokens, _, _ = await queue.get()
                self.taken += len(tokens)

        def run():
            asyncio.set_event_loop(self.loop)
            self.queues = [asyncio.Queue() for _ in range(requests)]
            for q in self.queues:
                self.loop.create_task(consume(q))
            self.loop.call_soon(ready.set)
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        ready.wait()

    def callback(self, k: int, batched: bool):
        """Request ``k``'s ``on_tokens``: one way or the other."""
        queue = self.queues[k]
        if batched:
            def on_tokens(tokens, logprobs, version):
                self.inbox.post(queue, (tokens, logprobs, version), wake=False)
            on_tokens.flush = self.inbox.flush
        else:
            def on_tokens(tokens, logprobs, version):
                self.loop.call_soon_threadsafe(queue.put_nowait, (tokens, logprobs, version))
        return on_tokens

    def wait_for(self, taken: int, timeout: float = 30.0) -> None:
        """Until the loop has taken ``taken`` tokens in all."""
        deadline = time.time() + timeout
        while self.taken < taken and time.time() < deadline:
            time.sleep(0.0005)

    def stop(self) -> None:
        async def shutdown():
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def measure(decoder: SlotDecoder, server: Server, slots: int, steps: int, batched: bool) -> dict:
    """``steps`` hand-overs of one token to each of ``slots`` requests; per-token figures."""
    running = {s: Request(f"r{s}", decoder.max_new_tokens, streamed=True, on_tokens=server.callback(s, batched))
               for s in range(slots)}
    streams = TokenStreams(lambda adapter: 0, threading.Event())
    decoder.generated.zero_()
    start_taken = server.taken
    emit_s = 0.0
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for k in range(steps):
        decoder.generated[:slots] = min(k + 1, decoder.max_new_tokens)
        t = time.perf_counter()
        streams.emit(running, decoder)
        emit_s += time.perf_counter() - t
    tokens = slots * min(steps, decoder.max_new_tokens)
    server.wait_for(start_taken + tokens)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    return {"way": "batched" if batched else "per-choice", "emit_us_per_token": 1e6 * emit_s / tokens,
            "process_cpu_us_per_token": 1e6 * cpu / tokens, "wall_ms_per_step": 1e3 * wall / steps,
            "delivered": server.taken - start_taken == tokens}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--slots", type=int, default=256)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--steps", type=int, default=200, help="hand-overs per measurement (at most max-new-tokens count)")
    p.add_argument("--rounds", type=int, default=3, help="measurements of each way, alternating")
    p.add_argument("--out", help="write the rows as JSON here")
    args = p.parse_args()
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
    decoder = SlotDecoder(model, args.slots, 32 + args.max_new_tokens, args.max_new_tokens, 1.0, stop_ids=[0],
                          graphs=False)
    server = Server(args.slots)
    rows = []
    try:
        for r in range(args.rounds):
            for batched in ((False, True) if r % 2 == 0 else (True, False)):
                rows.append(measure(decoder, server, args.slots, min(args.steps, args.max_new_tokens), batched))
                print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in rows[-1].items()}))
    finally:
        server.stop()
    summary = {}
    for way in ("per-choice", "batched"):
        mine = [x for x in rows if x["way"] == way]
        summary[way] = {k: round(statistics.median(x[k] for x in mine), 2)
                        for k in ("emit_us_per_token", "process_cpu_us_per_token", "wall_ms_per_step")}
    summary["ratio_process_cpu"] = round(summary["per-choice"]["process_cpu_us_per_token"]
                                         / summary["batched"]["process_cpu_us_per_token"], 2)
    print(json.dumps({"slots": args.slots, "max_new_tokens": args.max_new_tokens, **summary}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows, "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
