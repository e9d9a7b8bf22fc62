"""Built-in tool-call parsers (``[serve] tool_parser``): a model's reply text to OpenAI's
``tool_calls``.

``hermes`` reads the ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks that
Qwen2.5/Qwen3, Hermes and the shipped tiny calculator model write (vLLM calls this format
``hermes`` too). A block whose JSON does not parse, or lacks a ``name``, stays in the content.
"""

from __future__ import annotations

import json
import re

from pydantic import BaseModel, ConfigDict

from streamrl.contracts.agents import ToolParser

# a block ends at its closing tag, or at the end of the reply (a model that stopped right after
# the JSON, its end of turn doubling as the closing tag)
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


class HermesConfig(BaseModel):
    """``tool_parser = "hermes"`` takes no options."""

    model_config = ConfigDict(extra="forbid")


class HermesToolParser(ToolParser):
    """``<tool_call>{json}</tool_call>`` blocks (see the module's docstring)."""

    start = "<tool_call>"

    def __init__(self, config: HermesConfig | None = None):
        self.config = config

    def parse(self, text: str) -> tuple[str | None, list[dict[str, str]]]:
        """The reply's content outside its parsed blocks, and the calls in order."""
        calls, kept, at = [], [], 0
        for m in _BLOCK.finditer(text):
            call = _call(m.group(1))
            if call is None:
                continue
            kept.append(text[at:m.start()])
            at = m.end()
            calls.append(call)
        kept.append(text[at:])
        content = "".join(kept).strip()
        return (content or None) if calls else text, calls


def _call(body: str) -> dict[str, str] | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return {"name": obj["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}
