"""The example plugin's own tests: its components, and that streamrl discovers them."""

from streamrl.plugins.registry import build_registry
from streamrl.api import Prompt
from streamrl_example.digit_match import DigitMatch, DigitMatchConfig
from streamrl_example.rloo import RLOO, RLOOConfig


def test_digit_match_gives_partial_credit():
    reward = DigitMatch(DigitMatchConfig(length_penalty=0.5))
    prompt = Prompt(uid="0", text="37+48=", answer="85")
    assert reward.score(prompt, "85") == 1.0
    assert reward.score(prompt, "84") == 0.5
    assert reward.score(prompt, "5") == 0.0  # one place right of two, minus the length penalty


def test_rloo_baseline_leaves_the_sample_out():
    assert RLOO(RLOOConfig()).advantages([1.0, 0.0, 0.0]) == [1.0, -0.5, -0.5]
    assert RLOO(RLOOConfig()).advantages([1.0]) == [0.0]


def test_streamrl_discovers_the_entry_point():
    registry = build_registry()
    assert registry.get("reward", "digit_match", "reward.name").factory is DigitMatch
    assert registry.get("algorithm", "example_rloo", "algorithm.name").plugin == "example"
