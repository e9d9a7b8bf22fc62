"""An agent written only against OpenAI's API: it asks the model, runs the ``calc`` tool the
model calls, hands back the result, and returns 1 when the final answer is right.

    [task]
    name = "agent"
    path = "../examples/agent/calculator_agent.py"
    function = "rollout"

``client`` is an ``openai.AsyncOpenAI`` already pointed at the run's endpoint; every call it
makes joins this rollout's trajectory, which the learners train on token for token.
"""

import json

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


async def rollout(client, row):
    messages = [{"role": "user", "content": row["prompt"]}]
    tool_calls = 0
    for _ in range(3):  # at most three replies: call, read, answer
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=64)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            tool_calls += 1
            try:
                result = calc(json.loads(call.function.arguments)["x"])
            except (json.JSONDecodeError, KeyError, TypeError):
                result = "error"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    answer = (messages[-1].get("content") or "").strip() if messages[-1]["role"] == "assistant" else ""
    return {"score": float(answer == row["answer"]), "used_tool": float(tool_calls > 0)}
