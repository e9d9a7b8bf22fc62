"""What a run keeps, and lets go, between steps: generation kept for loads that never come, a
feed's groups after their step, the ranker's lessons in the scheduler. On a cluster of their own
(``tests/test_controller.py``'s): a controller submits the same task keys as one before it, and
Dask answers a key still held with the old task."""

from __future__ import annotations

import pytest

from streamrl.plugins.resolve import resolve
from streamrl.recipe.recipe import load_recipe
from streamrl.run.controller import Controller
from tests.test_controller import SMALL, W3, four_workers, run_steps


pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client():
    yield from four_workers()


def test_a_repeatable_run_that_publishes_nothing_keeps_no_generation_for_loads(client):
    # (run.serve = "initial": the engines keep the starting model) every generate future was kept
    # for the next version's loads, which never come: the run's every sample stayed in memory
    from streamrl.cluster import lifecycle

    resolved = resolve(load_recipe(W3, SMALL + ["run.steps=3", "run.mode=stream"]))
    ctl = Controller(resolved, client, lifecycle.pool_workers(client))
    ctl.place_residents()
    ctl.repeatable = True  # (as an engine whose samples repeat for a seed makes it)
    ctl.context.publishes = False
    for s in range(3):
        ctl.step(s)
    assert ctl.generating == {}


def test_the_groups_a_feed_handed_to_the_trainer_are_let_go_once_their_step_took_them(client):
    # (held a step longer, a lost reward worker's groups of a step already trained were made and
    # scored again)
    from streamrl.cluster import lifecycle

    resolved = resolve(load_recipe(W3, SMALL + ["run.steps=2", "run.mode=async", "run.max_staleness=1"]))
    ctl = Controller(resolved, client, lifecycle.pool_workers(client))
    ctl.place_residents()
    ctl.step(0, start_next_training=True)
    assert ctl.next_training is not None and ctl.next_training_groups  # (step 1's, fed early)
    ctl.step(1, start_next_training=False)
    assert ctl.next_training_groups == []


def test_the_rankers_lessons_do_not_keep_each_other_in_the_scheduler(client):
    # each lesson was made the next one's dependency, done or not: Dask keeps a task that has a
    # dependent, so the scheduler held every step's lesson, its prompts with it, for the whole run
    run_steps(client, ['scheduler={name="skew"}', 'ranker={name="learned"}'], steps=6)

    def lessons(dask_scheduler):
        return sorted(str(k) for k in dask_scheduler.tasks if str(k).startswith("observe-"))

    held = client.run_on_scheduler(lessons)
    assert len(held) <= 2, held
