"""Reproducible sampling: one prompt group decoded by its own loop with its own random generator.

Continuous batching shares one random stream among whatever requests happen to be in a batch,
so which tokens a request draws depends on arrival timing. Here a group is decoded alone (``n``
copies of one prompt, so the batch and hence the arithmetic are the same every time) and draws
from a ``torch.Generator`` seeded by the run's seed and the prompt's uid: the same seed gives
the same samples whatever else the worker is doing. The price is no batching across groups.

:class:`SeededEngine` is the ``hf`` engine with ``reproducible = true``: each group is decoded
in the generate task that asks for it, under the model lock, so a group never sees two policies.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Sequence

import torch

from streamrl.engines.base import TransformersEngine
from streamrl.engines.decode import decode_batch
from streamrl.sample import Group, Prompt


def group_generator(seed: int, uid: str) -> torch.Generator:
    """The random stream of one prompt group: a function of the run's seed and the prompt only."""
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(uid.encode()))


def sample_group(model, ids: list[int], n: int, max_new_tokens: int, temperature: float,
                 stop_ids: Sequence[int], generator: torch.Generator) -> list[tuple[list[int], list[float]]]:
    """``n`` sampled responses to the prompt ``ids``: ``[(tokens, logprobs)]``, each ending at
    its first token of ``stop_ids`` (included) or after ``max_new_tokens``. Logprobs are of the tempered
    distribution, as the trainer computes them."""
    return decode_batch(model, [ids] * n, max_new_tokens, temperature, stop_ids, generator=generator)


class SeededEngine(TransformersEngine):
    """The ``hf`` engine decoding each group alone with its own seeded generator; no loop, no
    queue (its :meth:`requests_in_flight` stays ``(0, 0)``), no latency profile."""

    def generate_groups(self, prompts: list[Prompt], n: int, priorities: list[float]) -> list[Group]:
        """One group of ``n`` samples per prompt, one after another in the calling task;
        ``priorities`` do not matter, as nothing queues."""
        return [self._generate_seeded(p, n) for p in prompts]

    def _generate_seeded(self, prompt: Prompt, n: int) -> Group:
        ids = self.prompt_ids(prompt)
        with self._model_lock:
            start, version = time.time(), self.version
            out = sample_group(self.model, ids, n, self.config.max_new_tokens, self.config.temperature,
                               self.stop_ids, group_generator(self.config.seed or 0, prompt.uid))
            end = time.time()
        return [self.make_sample(prompt, ids, f"{prompt.uid}-{k}", tokens, logprobs, version, start, end)
                for k, (tokens, logprobs) in enumerate(out)]
