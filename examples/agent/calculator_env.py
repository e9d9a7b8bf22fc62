"""The calculator task as a gym-style environment: streamrl runs the loop (``reset``, then a
model reply and ``step`` per turn) and sums the rewards.

    [task]
    name = "agent"
    path = "../examples/agent/calculator_env.py"
    environment = "Calculator"
    max_turns = 3
"""

import json

from streamrl.api import Environment

TOOLS = [{"type": "function", "function": {
    "name": "calc", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}}}]


def calc(x) -> str:
    """The tool: ``a*b`` (or + -) of whole numbers of at most 100 digits; anything else is an
    error message (the model writes the arguments: they may be anything)."""
    if not isinstance(x, str) or len(x) > 201:
        return "error"
    for op in "*+-":
        left, sep, right = x.partition(op)
        left, right = left.strip(), right.strip()
        # (ASCII digits only: "²".isdigit() is True, and int() refuses it)
        if sep and left.isascii() and right.isascii() and left.isdigit() and right.isdigit():
            a, b = int(left), int(right)
            return str(a * b if op == "*" else a + b if op == "+" else a - b)
    return "error"


class Calculator(Environment):
    tools = TOOLS

    def reset(self, row):
        self.answer = row["answer"]
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, message):
        calls = message.get("tool_calls") or []
        if not calls:  # a final answer: the episode ends, scored
            return [], float((message.get("content") or "").strip() == self.answer), True
        results = []
        for call in calls:
            try:
                result = calc(json.loads(call["function"]["arguments"])["x"])
            except (json.JSONDecodeError, KeyError, TypeError):
                result = "error"
            results.append({"role": "tool", "tool_call_id": call["id"], "content": result})
        return results, 0.0, False
