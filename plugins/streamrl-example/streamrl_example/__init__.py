"""streamrl-example: two components registered through streamrl's hooks.

streamrl finds this module through the ``streamrl`` entry point in ``pyproject.toml``, calls the
``register_*`` hooks below once, and from then on a recipe can name ``digit_match`` and
``rloo`` like any built-in.
"""

from __future__ import annotations

import streamrl
from streamrl.plugins import Component

from streamrl_example.digit_match import DigitMatch, DigitMatchConfig
from streamrl_example.rloo import RLOO, RLOOConfig


@streamrl.hookimpl
def register_rewards():
    return [Component("reward", "digit_match", DigitMatchConfig, DigitMatch)]


@streamrl.hookimpl
def register_algorithms():
    return [Component("algorithm", "rloo", RLOOConfig, RLOO)]
