"""A LoRA learner's variant served by the served policy's own engines.

A side learner that trains a LoRA adapter (``TrainerCapabilities.adapter``) does not need an
engine of its own to be served: its adapter is loaded into every generate worker's engine beside
the served policy's (``engines/adapters.py``; ``learners/served.py`` pushes each new one), and a
request naming ``<model_name>/<learner>`` is decoded by those engines with that adapter, in the
same decode steps as every other request. So every variant gets the served policy's engines,
and with them its time to first token.

:class:`OnAdapter` is such an engine as the endpoint sees it: the slot engine's (or a replica's)
``stream`` / ``cancel`` face, every request asked with the learner's adapter.
"""

from __future__ import annotations

from concurrent.futures import Future

from streamrl.engines.stop_tokens import of_engine


class OnAdapter:
    """``engine`` (a local slot engine, or a replica's :class:`~streamrl.serve.remote_engines.RemoteEngine`)
    answering with adapter ``adapter``."""

    def __init__(self, engine, adapter: str):
        self.engine, self.adapter = engine, adapter
        self.config, self.tokenizer, self.encode = engine.config, engine.tokenizer, engine.encode
        self.stop_ids = of_engine(engine)
        """The tokens that end its responses (its engine's)."""
        self.worker = getattr(engine, "worker", "")  # (a local engine has none: the endpoint's own worker)
        """The worker it decodes on."""

    @property
    def version(self) -> int:
        """The version of the adapter's policy it decodes with (a replica's: the newest it sent)."""
        held = getattr(self.engine, "adapters", None)  # (a local engine's bank; a replica has none here)
        return held.versions.get(self.adapter, 0) if held is not None else self.engine.version

    @property
    def failed_at(self) -> float:
        """When a request last failed to reach the engine (the endpoint passes it over a while)."""
        return getattr(self.engine, "failed_at", 0.0)

    def stream(self, rid: str, ids: list[int], max_new_tokens: int, on_tokens=None, greedy: bool = False,
               prompt=None) -> Future:
        """The engine's ``stream``, with the learner's adapter."""
        return self.engine.stream(rid, ids, max_new_tokens, on_tokens=on_tokens, greedy=greedy, prompt=prompt,
                                  adapter=self.adapter)

    def cancel(self, rid: str) -> None:
        """Stop request ``rid`` (its future gets the tokens so far)."""
        self.engine.cancel(rid)
