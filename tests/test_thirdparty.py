"""Third-party plugins as real installed distributions (``plugins/`` packages, pip-installed).

The packages are installed with ``pip install --target`` into a folder put on ``PYTHONPATH`` of
the ``streamrl`` subprocess (and so of its Dask workers): the test environment itself is not
changed, and no test code imports the plugin -- streamrl must find it through its entry point.
"""

from __future__ import annotations

import csv
import importlib.util
import os
import re
import subprocess
import sys

import pytest

from tests import helpers
from tests.helpers import ROOT, read_records


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """A folder holding the installed ``streamrl-example``, ``streamrl-broken`` and ``streamrl-vllm``
    distributions (the last without vLLM itself: its own tests run on vLLM, in .venv-vllm)."""
    target = tmp_path_factory.mktemp("site")
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
           str(ROOT / "plugins" / "streamrl-example"), str(ROOT / "plugins" / "streamrl-broken"),
           str(ROOT / "plugins" / "streamrl-vllm")]
    if importlib.util.find_spec("setuptools"):
        cmd.insert(4, "--no-build-isolation")  # build offline with the setuptools we have
    subprocess.run(cmd, check=True, timeout=300)
    return target


def streamrl(site, *args, disable: str = "") -> subprocess.CompletedProcess:
    """The command with the plugins in ``site`` installed (and those in ``disable`` disabled)."""
    return helpers.streamrl(*args, env=dict(os.environ, PYTHONPATH=str(site), STREAMRL_DISABLE_PLUGINS=disable))


def test_installed_plugin_is_listed_with_its_distribution_and_broken_one_is_reported(site):
    proc = streamrl(site, "plugins", "list")
    assert proc.returncode == 0, proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines()]
    assert ["reward", "digit_match", "example", "streamrl-example", "0.1.0"] in rows
    assert ["algorithm", "example_rloo", "example", "streamrl-example", "0.1.0"] in rows
    assert ["reward", "exact_match", "streamrl.builtins", "streamrl"] == rows[[r[1] for r in rows].index("exact_match")][:4]
    warning = [line for line in proc.stderr.splitlines() if "streamrl-broken" in line]
    assert len(warning) == 1 and "a_module_that_is_not_installed" in warning[0]
    assert "Traceback" not in proc.stderr


def test_disabled_plugin_is_not_loaded(site):
    proc = streamrl(site, "plugins", "list", disable="broken,example")
    assert proc.returncode == 0, proc.stderr
    assert "streamrl-broken" not in proc.stderr
    assert "digit_match" not in proc.stdout and "exact_match" in proc.stdout


def test_unknown_name_lists_installed_components(site, tiny_recipe):
    proc = streamrl(site, "recipe", "validate", str(tiny_recipe), "--set", 'reward.name="digit_mach"')
    assert proc.returncode == 2
    assert "reward.name" in proc.stderr and "digit_match, exact_match" in proc.stderr
    assert "did you mean 'digit_match'" in proc.stderr


def test_plugin_config_error_names_the_toml_path(site, tiny_recipe):
    proc = streamrl(site, "recipe", "validate", str(tiny_recipe), "--set", 'reward.name="digit_match"',
                    "--set", "reward.length_penalty=3")
    assert proc.returncode == 2
    assert "reward.length_penalty" in proc.stderr.splitlines()[-1]


@pytest.mark.slow
def test_recipe_runs_end_to_end_with_the_installed_plugin(site, tiny_recipe, tmp_path):
    # the shipped warm-started model answers about half the sums right, so a reward that ran
    # cannot be all zeros (an untrained model's output made this check a coin toss)
    text = tiny_recipe.read_text().replace('name = "exact_match"', 'name = "digit_match"\nlength_penalty = 0.25')
    text = re.sub(r'path = ".*"', f'path = "{ROOT / "models" / "tiny-addition"}"', text, count=1)
    text += '\n[algorithm]\nname = "example_rloo"\n\n[[metrics]]\nname = "csv"\n'
    tiny_recipe.write_text(text)
    proc = streamrl(site, "recipe", "run", str(tiny_recipe))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "streamrl-broken" in proc.stderr  # reported, and the run still succeeded
    (run_dir,) = (tmp_path / "runs").iterdir()
    records = read_records(run_dir)
    assert len(records) == 2 and records[-1]["reward_errors"] == 0
    # the plugin's reward ran on the reward worker and scored real answers
    assert sum(r["reward_mean"] for r in records) > 0
    rows = list(csv.DictReader((run_dir / "metrics.csv").open()))
    assert [int(r["step"]) for r in rows] == [0, 1]
    assert 'name = "example_rloo"' in (run_dir / "recipe.toml").read_text()


def test_example_package_own_tests_pass(site):
    env = dict(os.environ, PYTHONPATH=str(site))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(ROOT / "plugins" / "streamrl-example" / "tests")],
                          cwd=ROOT / "plugins" / "streamrl-example", env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "3 passed" in proc.stdout


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_vllm_engine_without_vllm_is_a_one_line_error_that_says_how_to_install_it(site, tmp_path):
    listed = streamrl(site, "plugins", "list")
    assert any(line.split()[:2] == ["engine", "vllm"] for line in listed.stdout.splitlines()), listed.stdout
    proc = streamrl(site, "recipe", "run", "recipes/addition.toml", "--set", "engine.name=vllm",
                    "--set", "run.steps=1", "--set", f'run.out_dir="{tmp_path}"', "--set", "cluster.dashboard_port=0")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("streamrl: error:")]
    assert "engine 'vllm' needs vllm on this worker" in line and "streamrl-vllm README" in line
