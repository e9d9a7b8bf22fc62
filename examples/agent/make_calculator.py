"""Make the calculator task's data and its tiny tool-calling model.

    python examples/agent/make_calculator.py          # data/calculator/*.jsonl, models/tiny-calculator

The task: multiply two 2-digit numbers, which a model of a few hundred thousand parameters
cannot do in its head, with a ``calc`` tool it can call. The model is a character-level Llama
whose chat template knows tools (``<tool_call>{json}</tool_call>``, the common "hermes" style,
and a ``tool`` role) and whose end of turn is its end of sequence. Its supervised warm start
shows it both ways of answering -- guessing the product at once, or calling the tool and
copying its result -- with the tool in only a minority of examples, so it starts out mostly
guessing (and mostly wrong); RL on the agent's rollouts then teaches it that the tool pays.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from streamrl.tasks.tiny import save, tiny_llama

ROOT = Path(__file__).resolve().parents[2]
ALPHABET = "0123456789+-*/=?. ,:{}\"_abcdefghijklmnopqrstuvwxyzW"
SPECIALS = ["<pad>", "<bos>", "<|end|>"]  # the end of a turn is the end of sequence
ROLES = ["<|system|>", "<|user|>", "<|assistant|>", "<|tool|>"]
CALL_TAGS = ["<tool_call>", "</tool_call>"]  # ordinary tokens: they stay in the decoded text

#: Tools listed in a system turn; an assistant's tool calls written as ``<tool_call>{json}</tool_call>``.
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- if tools -%}<|system|>tools: {{ tools | map(attribute='function.name') | join(',') }}<|end|>{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}<|assistant|>{{ m['content'] or '' }}"
    "{%- for c in m.get('tool_calls') or [] -%}"
    "<tool_call>{\"name\": \"{{ c['function']['name'] }}\", \"arguments\": {{ c['function']['arguments'] | tojson }}}</tool_call>"
    "{%- endfor -%}<|end|>"
    "{%- else -%}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}")

TOOLS = [{"type": "function", "function": {"name": "calc", "description": "Evaluate an arithmetic expression.",
                                           "parameters": {"type": "object", "properties": {"x": {"type": "string"}},
                                                          "required": ["x"]}}}]


def tokenizer() -> PreTrainedTokenizerFast:
    """One token per character, the chat and role tokens, and the two tool-call tags."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS + ROLES + CALL_TAGS)}
    for ch in ALPHABET:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    out = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<|end|>",
                                  additional_special_tokens=ROLES)
    out.add_tokens(CALL_TAGS)
    out.chat_template = CHAT_TEMPLATE
    return out


def question(rng: random.Random) -> tuple[str, str]:
    """A product of two 2-digit numbers, and its value."""
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    return f"What is {a}*{b}?", str(a * b)


def conversation(rng: random.Random, use_tool: bool) -> tuple[list[dict], list[str]]:
    """A solved example: the messages, and which of them are the model's own (trained)."""
    q, answer = question(rng)
    expr = q[len("What is "):-1]
    messages = [{"role": "user", "content": q}]
    if use_tool:
        call = {"id": "c", "type": "function", "function": {"name": "calc", "arguments": {"x": expr}}}
        messages += [{"role": "assistant", "content": "", "tool_calls": [call]},
                     {"role": "tool", "content": answer}, {"role": "assistant", "content": answer}]
    else:  # a guess: the model's own product, right only by luck once trained this way
        messages += [{"role": "assistant", "content": answer}]
    return messages, answer


def encode_with_mask(tok, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Token ids of the rendered conversation, and 1 on the assistant's own tokens (each reply
    and its end of turn; not the ``<|assistant|>`` header, which the prompt carries), 0 elsewhere."""
    def render(upto: int, header: bool) -> str:
        return tok.apply_chat_template(messages[:upto], tools=TOOLS, tokenize=False, add_generation_prompt=header)

    ids, mask, done = [], [], ""
    for k, m in enumerate(messages):
        if m["role"] == "assistant":
            head = render(k, True)
            ids += tok(head[len(done):], add_special_tokens=False).input_ids
            mask += [0] * (len(ids) - len(mask))
            done = head
        full = render(k + 1, False)
        ids += tok(full[len(done):], add_special_tokens=False).input_ids
        mask += [1 if m["role"] == "assistant" else 0] * (len(ids) - len(mask))
        done = full
    return ids, mask


def make_data(out: Path, train: int, test: int, seed: int = 0) -> None:
    """``train.jsonl`` and ``test.jsonl`` rows: ``{"prompt", "answer"}``."""
    rng = random.Random(seed)
    out.mkdir(parents=True, exist_ok=True)
    for name, n in (("train", train), ("test", test)):
        with open(out / f"{name}.jsonl", "w") as f:
            for _ in range(n):
                q, a = question(rng)
                f.write(json.dumps({"prompt": q, "answer": a}) + "\n")


def warm_start(model, tok, steps: int, tool_share: float, seed: int = 0, batch: int = 64, lr: float = 3e-3) -> dict:
    """Next-token cross-entropy on the assistant's tokens of solved conversations."""
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min(1.0, (i + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(i, steps) / steps)))
    model.train()
    t0, loss_value = time.perf_counter(), float("nan")
    for step in range(steps):
        rows = [encode_with_mask(tok, conversation(rng, rng.random() < tool_share)[0]) for _ in range(batch)]
        width = max(len(ids) for ids, _ in rows)
        ids = torch.full((batch, width), tok.pad_token_id)
        labels = torch.full((batch, width), -100)
        for i, (row, mask) in enumerate(rows):
            ids[i, :len(row)] = torch.tensor(row)
            labels[i, :len(row)] = torch.where(torch.tensor(mask) > 0, torch.tensor(row), -100)
        loss = model(input_ids=ids, attention_mask=(ids != tok.pad_token_id).long(), labels=labels).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        loss_value = loss.item()
        if step % 100 == 0 or step == steps - 1:
            print(f"warm start step {step}: loss {loss_value:.3f}")
    model.eval()
    return {"steps": steps, "loss": loss_value, "seconds": round(time.perf_counter() - t0, 1), "tool_share": tool_share}


def main() -> None:
    """Write the data and the model (see the module's docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(ROOT / "data" / "calculator"))
    ap.add_argument("--out", default=str(ROOT / "models" / "tiny-calculator"))
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--tool-share", type=float, default=0.3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    make_data(Path(args.data), 4000, 200, args.seed)
    torch.manual_seed(args.seed)
    tok = tokenizer()
    model = tiny_llama(len(tok), max_positions=192, seed=args.seed)
    model.config.eos_token_id = tok.eos_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    report = {"task": "calculator", "parameters": sum(p.numel() for p in model.parameters()),
              "warm_start": warm_start(model, tok, args.steps, args.tool_share, args.seed)}
    save(model, tok, args.out)
    (Path(args.out) / "streamrl_init.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
