"""streamrl-example: two components registered through streamrl's hooks.

streamrl finds this module through the ``streamrl`` entry point in ``pyproject.toml``, calls the
``register_*`` hooks below once, and from then on a recipe can name ``digit_match`` and
``rloo`` like any built-in.
"""

from __future__ import annotations

from streamrl.api import Component, hookimpl

from streamrl_example.digit_match import DigitMatch, DigitMatchConfig
from streamrl_example.rloo import RLOO, RLOOConfig


@hookimpl
def register_rewards():
    return [Component("reward", "digit_match", DigitMatchConfig, DigitMatch)]


@hookimpl
def register_algorithms():
    return [Component("algorithm", "example_rloo", RLOOConfig, RLOO)]
