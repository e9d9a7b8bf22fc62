"""What each served model answered and earned: the figures an A/B comparison of the variants
an endpoint serves reads (``serve/variants`` in a step's record, ``GET /v1/serve/stats``).

Totals since the endpoint started, and the latest :data:`RECENT` rewards and latencies: an
endpoint that serves for months keeps a bounded window, and its recent figures follow the
policy as it learns rather than averaging over every policy it ever served.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

#: How many of a model's latest rewards and latencies its recent figures are taken over.
RECENT = 256


@dataclass
class ModelTally:
    """What one served model (the served policy, or a learner's) has answered and earned: the
    figures an A/B comparison of variants reads."""

    requests: int = 0
    completions: int = 0
    rewarded: int = 0
    stale_dropped: int = 0
    reward_sum: float = 0.0
    rewards: deque = field(default_factory=lambda: deque(maxlen=RECENT))
    first_token_s: deque = field(default_factory=lambda: deque(maxlen=RECENT))
    token_s: deque = field(default_factory=lambda: deque(maxlen=RECENT))

    def report(self) -> dict:
        """Totals, the mean reward (all, and the latest :data:`RECENT`), and the latest
        requests' time to first token (p50, p99) and time between tokens (p50), in ms."""
        def pct(values, q):
            v = sorted(values)
            return round(1000 * v[min(len(v) - 1, int(q * len(v)))], 2) if v else None
        return {"requests": self.requests, "completions": self.completions, "rewarded": self.rewarded,
                "stale_dropped": self.stale_dropped,
                "reward_mean": round(self.reward_sum / self.rewarded, 6) if self.rewarded else None,
                "reward_recent": round(sum(self.rewards) / len(self.rewards), 6) if self.rewards else None,
                "ttft_p50_ms": pct(self.first_token_s, 0.5), "ttft_p99_ms": pct(self.first_token_s, 0.99),
                "itl_p50_ms": pct(self.token_s, 0.5)}
