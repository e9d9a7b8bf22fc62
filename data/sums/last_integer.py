"""The reward of ``recipes/smollm2-sums.toml`` (``[reward] name = "python"``, verl's signature):
1.0 when the last integer the response writes is the answer, else 0.0. A model that explains
("To add 59 and 63 ... the answer is 122.") is right too if it ends on the sum; one that stops
before the number is not."""

import re

INTEGER = re.compile(r"-?\d[\d,]*")


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """1.0 when the response's last integer (thousands separators allowed) equals ``ground_truth``."""
    found = INTEGER.findall(solution_str[-2000:])  # (a bounded look: the answer ends the reply)
    if not found:
        return 0.0
    try:
        return 1.0 if int(found[-1].replace(",", "")) == int(ground_truth) else 0.0
    except ValueError:
        return 0.0
