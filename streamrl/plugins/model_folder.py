"""What a recipe's model folder says about the run before any cluster starts: how many positions
the model has (the engine's ``max_new_tokens`` and the prompts must fit them) and how the model
would sample on its own (said when the engine samples otherwise). Its JSON files are read
bounded: they are the user's."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

from streamrl.errors import RunWarning, UserError

#: Where a model's config.json says how many positions (prompt and response together) it has.
POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")

#: Bytes of a model's ``config.json`` read at most (a real one is a few KB).
MAX_CONFIG_BYTES = 4 * 2**20


def model_config(model: Path, name: str = "config.json") -> object:
    """The parsed ``config.json`` (or ``name``, another JSON file of it) of the model folder
    ``model`` (``ValueError``: a phrase saying why it cannot be read). A regular file of bounded
    size, read before it is parsed: a FIFO there waited for ever, a link to /dev/zero filled the
    memory, JSON nested without end raised a RecursionError."""
    path = model / name
    try:
        if not path.is_file():
            raise ValueError("is not a file" if path.exists() else "is missing")
        size = path.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise ValueError(f"has {size} bytes; a model's config.json is at most {MAX_CONFIG_BYTES}")
        data = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot be read ({type(exc).__name__})") from None
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"cannot be read ({type(exc).__name__})") from None


def model_positions(model: Path, config: dict | None = None) -> tuple[str, int] | None:
    """``(key, positions)``: how many positions (prompt and response together) the model at
    ``model`` has, and the ``config.json`` key that says so; None where it cannot say (no
    readable config, no such key). ``config``: the file's contents, when read already."""
    if config is None:
        try:
            config = model_config(model)
        except ValueError:
            return None
    if not isinstance(config, dict):
        return None
    text = config.get("text_config")
    if isinstance(text, dict):  # (a multimodal model's language part)
        config = {**config, **text}
    key = next((k for k in POSITION_KEYS if isinstance(config.get(k), int) and config[k] > 0), None)
    return None if key is None else (key, config[key])


def say_sampling(out, model: Path) -> None:
    """A warning when the model's ``generation_config.json`` samples otherwise than the engine
    of ``out`` (the resolved recipe) will: Qwen2.5-Instruct's says temperature 0.7, top_p 0.8,
    top_k 20, and the engine samples at ``engine.temperature`` over the whole vocabulary (the
    learners train on exactly that distribution, so it is not changed behind the recipe's back;
    its replies are noisier)."""
    try:
        config = model_config(model, "generation_config.json") if (model / "generation_config.json").exists() else {}
    except ValueError:
        return  # (its generation settings are no one's business here: transformers reads them, or not)
    if not isinstance(config, dict) or config.get("do_sample") is False:
        return
    temperature = out.engine.capabilities().temperature

    said = {k: v for k in ("temperature", "top_p", "top_k")
            if isinstance(v := config.get(k), (int, float)) and not isinstance(v, bool)}
    unlike = {"temperature": lambda v: abs(v - temperature) > 1e-6, "top_p": lambda v: v < 1, "top_k": lambda v: v > 0}
    differs = [f"{k} {v:g}" for k, v in said.items() if unlike[k](v)]
    if differs:
        warnings.warn(RunWarning(f"model.path: {model / 'generation_config.json'} samples at {', '.join(differs)}; the "
                                 f"engine samples at engine.temperature = {temperature:g} over the whole vocabulary, "
                                 "the distribution the learners train on (set engine.temperature to sample nearer "
                                 "the model's own)"), stacklevel=2)


def check_positions(out, model: Path) -> None:
    """The engine's ``max_new_tokens`` must leave room for a prompt in the positions of the
    model of ``out`` (the resolved recipe): beyond them a model with learned positions fails,
    and one with rotary ones goes where it was never trained."""
    wanted = out.engine.capabilities().max_new_tokens
    try:
        config = model_config(model)
    except ValueError as exc:
        raise UserError(f"model.path: {model / 'config.json'} {exc}") from None
    found = model_positions(model, config)
    if not isinstance(wanted, int) or found is None:
        return
    key, limit = found
    if wanted >= limit:
        raise UserError(f"engine.max_new_tokens: {wanted} does not fit the model's {limit} positions "
                        f"({key} in {model / 'config.json'}), which the prompt and the response share; "
                        f"use less than {limit}")
