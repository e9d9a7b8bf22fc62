"""The tests' harness for the ``streamrl`` command (``tests/in_process.py``): a run in the test's
own process gives a test what the command's own process would have given it: the exit status,
the driver's output and warnings, and what its workers print."""

from __future__ import annotations

import subprocess
import time

import pytest

from tests.helpers import only_run, read_records, streamrl, with_plugin

LOUD_REWARD = '''
import sys
import warnings

from pydantic import BaseModel

from streamrl.api import Component, Reward, hookimpl

warnings.warn("loud reward: imported", UserWarning)


class Empty(BaseModel):
    pass


class Loud(Reward):
    """Prints from the worker it scores on, to both streams; scores 1.0."""

    def __init__(self, config):
        pass

    def score(self, prompt, response):
        print("loud reward: to stderr, from a worker", file=sys.stderr, flush=True)
        print("loud reward: to stdout, from a worker", flush=True)
        return 1.0


@hookimpl
def register_rewards():
    return [Component("reward", "loud", Empty, Loud)]
'''


@pytest.mark.slow
def test_a_run_in_the_test_process_gives_what_its_own_process_gives(tiny_recipe, tmp_path):
    recipe = with_plugin(tiny_recipe, "loud", LOUD_REWARD, replace=('name = "exact_match"', 'name = "loud"'))
    seen = {}
    # twice in this process (the second reuses its fork server, whose workers inherited the
    # first run's capture), then as a process of its own
    for how, fresh in (("here", False), ("here again", False), ("own process", True)):
        out = tmp_path / how.replace(" ", "-")
        proc = streamrl("recipe", "run", str(recipe), "--plain", "--no-report", "--set", f'run.out_dir="{out}"',
                        "--set", "cluster.dashboard=false", fresh=fresh)
        assert proc.returncode == 0, (how, proc.stderr[-3000:])
        assert "loud reward: to stderr, from a worker" in proc.stderr, (how, proc.stderr[-3000:])
        assert "loud reward: to stdout, from a worker" in proc.stdout, (how, proc.stdout[-3000:])
        assert "UserWarning: loud reward: imported" in proc.stderr, (how, proc.stderr[-3000:])
        assert [r["reward_mean"] for r in read_records(only_run(out))] == [1.0, 1.0]
        seen[how] = [line for line in proc.stderr.splitlines() if line.startswith("step ")]
    # the same step lines, each run's own: nothing of one run's output in another's
    assert len(seen["here"]) == len(seen["here again"]) == len(seen["own process"]) == 2, seen


def test_a_command_that_hangs_in_the_test_process_is_interrupted_at_its_timeout(tiny_recipe):
    # a plugin module that never finishes importing: nothing in the run would end it, so the
    # harness interrupts it as Ctrl-C would and raises what subprocess.run raises past a timeout
    recipe = with_plugin(tiny_recipe, "stuck", "import time\n\nprint('stuck: importing', flush=True)\ntime.sleep(600)\n")
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired) as caught:
        streamrl("recipe", "validate", str(recipe), timeout=10)  # (its imports may take seconds, loaded)
    assert time.monotonic() - started < 60
    assert "stuck: importing" in caught.value.stdout  # what it printed, as subprocess.run gives it
    # (what the interrupted command says depends on where the interrupt lands: not checked) and
    # the process is left as it was: the next command runs here and says what it always says
    again = streamrl("recipe", "validate", str(tiny_recipe))
    assert again.returncode == 0 and "stuck" not in again.stdout + again.stderr, again.stderr
