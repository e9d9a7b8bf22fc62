"""Make ``data/word-problems/``: short arithmetic word problems with ``\\boxed{}`` answers, in
verl's row layout, as parquet -- the shipped dataset of ``recipes/dataset.toml``.

    python data/make_word_problems.py            # writes train.parquet (3000 rows), test.parquet (200)

Each row: ``data_source``, ``prompt`` (one user message), ``ability``, ``reward_model``
(``{"style": "rule", "ground_truth": "7"}``), ``extra_info`` (``split``, ``index``) and
``solution`` (``"\\boxed{7}"``: what the tiny model's supervised warm start learns to write).
Numbers stay small (answers 0-18) so a model of a few hundred thousand parameters can learn
them on a CPU in minutes. Deterministic: the same files every time.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

NAMES = ["Ann", "Bob", "Cal", "Dee", "Eve", "Fay", "Gus", "Hal"]
THINGS = ["apples", "pens", "cups", "books", "coins", "hats"]


def problem(rng: random.Random) -> tuple[str, int]:
    """One (question, answer) pair: a sum or a difference told as a story."""
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    if rng.random() < 0.5:
        return f"{name} has {a} {thing} and gets {b} more. How many {thing} now?", a + b
    a, b = max(a, b), min(a, b)
    return f"{name} has {a} {thing} and gives {b} away. How many {thing} now?", a - b


def rows(n: int, split: str, seed: int) -> list[dict]:
    """``n`` rows of ``split`` in verl's layout (plus ``solution``)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        question, answer = problem(rng)
        out.append({"data_source": "word-problems", "prompt": [{"role": "user", "content": question}],
                    "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(answer)},
                    "extra_info": {"split": split, "index": i}, "solution": f"\\boxed{{{answer}}}"})
    return out


def main(out: Path) -> None:
    import datasets

    out.mkdir(parents=True, exist_ok=True)
    for split, n, seed in (("train", 3000, 1), ("test", 200, 2)):
        datasets.Dataset.from_list(rows(n, split, seed)).to_parquet(str(out / f"{split}.parquet"))
        print(f"{out / f'{split}.parquet'}: {n} rows")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent / "word-problems")
