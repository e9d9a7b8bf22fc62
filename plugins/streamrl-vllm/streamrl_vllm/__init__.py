"""streamrl-vllm: the ``vllm`` engine for streamrl.

streamrl finds this module through the ``streamrl`` entry point in ``pyproject.toml``. vLLM itself
is imported only when a generate worker starts the engine, so ``streamrl plugins list`` works (and
shows the engine) on a machine without vLLM; a recipe that uses it there fails at start-up with a
one-line error saying how to install it.
"""

from __future__ import annotations

from streamrl.api import Component, hookimpl
from streamrl_vllm.engine import VLLMEngine, VLLMEngineConfig


@hookimpl
def register_engines():
    return [Component("engine", "vllm", VLLMEngineConfig, VLLMEngine)]
