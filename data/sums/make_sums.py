"""Make ``data/sums/``: two-digit sums asked in words, in TRL's row layout (a chat ``prompt`` and
an ``answer``), as JSONL -- the data of ``recipes/smollm2-sums.toml``.

    python data/sums/make_sums.py            # writes train.jsonl (4000 rows), test.jsonl (200)

A question reads "What is 59 + 63? Reply with just the number."; the answer is the sum. The
held-out rows share no pair of numbers with the training rows. Deterministic: the same files
every time.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

QUESTION = "What is {a} + {b}? Reply with just the number."


def rows(pairs: list[tuple[int, int]]) -> list[dict]:
    """One row per ``(a, b)``: the question as one user message, the sum as the answer."""
    return [{"prompt": [{"role": "user", "content": QUESTION.format(a=a, b=b)}], "answer": str(a + b)}
            for a, b in pairs]


def main(folder: Path = Path(__file__).parent, train: int = 4000, test: int = 200, seed: int = 0) -> None:
    """Write ``train.jsonl`` and ``test.jsonl`` into ``folder``."""
    rng = random.Random(seed)
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    rng.shuffle(pairs)
    for name, part in (("test", pairs[:test]), ("train", pairs[test:test + train])):
        with open(folder / f"{name}.jsonl", "w") as f:
            for row in rows(part):
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
