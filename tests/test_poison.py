"""Nothing poisons, nothing is silent.

A step whose loss or gradient is not finite (a plugin algorithm returning NaN, a learning rate
far too high) is refused on the train worker before its update is applied, so no NaN weights
are ever published or checkpointed, and the run stops in one line naming the step and the last
checkpoint (``trainer.max_nonfinite_steps`` can let a few be skipped). A reward that fails for
every sample of a step stops the run in one line with its error; when only some fail, the
step's first error is kept in its record. Recipes that would train nothing, or past the model's
positions, are refused at validation.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from streamrl.algorithms.grpo import GRPO, GRPOConfig
from streamrl.api import EngineCapabilities, TrainerContext
from streamrl.cli import main
from streamrl.errors import NonFiniteStep
from streamrl.training.trainer import HFTrainer, HFTrainerConfig
from tests.helpers import make_groups, read_records, sets, streamrl, with_plugin


class NaNAfter(GRPO):
    """GRPO whose loss turns NaN while ``poisoned`` is set (a plugin's bug, on demand)."""

    poisoned = False

    def __init__(self, config):
        super().__init__(config)
        self.zero_advantage_no_gradient = False  # every sample reaches the loss, whatever its reward

    def loss(self, new, old, ref, adv, mask):
        per_sample, stats = super().loss(new, old, ref, adv, mask)
        return (per_sample * float("nan") if self.poisoned else per_sample), stats


def trainer_with(model, algorithm=None, **config) -> HFTrainer:
    return HFTrainer(HFTrainerConfig(**{"lr": 1e-2, **config}),
                     TrainerContext(str(model), algorithm or NaNAfter(GRPOConfig()), EngineCapabilities(temperature=1.0)))


def weights(trainer: HFTrainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def train_one_batch(trainer: HFTrainer, seed: int = 0) -> None:
    groups = make_groups(trainer, n_groups=3, seed=seed)
    for g in groups:
        trainer.micro_batch([g], scale=1.0 / 12)


# -- in the trainer -----------------------------------------------------------------------------------
class Buggy(GRPO):
    """GRPO whose loss has a bug of its own."""

    def __init__(self, config):
        super().__init__(config)
        self.zero_advantage_no_gradient = False

    def loss(self, new, old, ref, adv, mask):
        return {}["ratio"]


def test_an_algorithm_that_raises_stops_the_step_in_one_line_naming_it_and_where(tiny_model):
    from streamrl.errors import RunStopped

    trainer = trainer_with(tiny_model, algorithm=Buggy(GRPOConfig()))
    before = weights(trainer)
    with pytest.raises(RunStopped) as caught:
        train_one_batch(trainer)
    assert str(caught.value) == ("algorithm Buggy: loss() raised KeyError: 'ratio' (at test_poison.py:"
                                 f"{Buggy.loss.__code__.co_firstlineno + 1}, in loss); nothing of this step was applied")
    assert same(weights(trainer), before)


class Returns(GRPO):
    """GRPO whose loss hands back something the backward pass cannot use (``kind``)."""

    kind = ""

    def loss(self, new, old, ref, adv, mask):
        per_sample, stats = super().loss(new, old, ref, adv, mask)
        if self.kind == "detached":
            return per_sample.detach(), stats
        if self.kind == "per token":
            return new * mask, stats
        if self.kind == "one tensor":
            return per_sample
        return per_sample, {**stats, "per_sample_stat": per_sample.detach()}


@pytest.mark.parametrize("kind, said", [
    ("detached", "returned losses without a gradient"),
    ("per token", "returned per-sample losses of shape (4, "),
    ("one tensor", "returned Tensor; expected (per-sample losses [B], stats dict)"),
    ("a stat per sample", "returned the stat 'per_sample_stat' as (4,); expected one number")])
def test_an_algorithm_whose_loss_cannot_be_trained_stops_the_step_in_one_line(tiny_model, kind, said):
    from streamrl.errors import RunStopped

    algorithm = Returns(GRPOConfig())
    algorithm.kind = kind
    trainer = trainer_with(tiny_model, algorithm=algorithm)
    before = weights(trainer)
    with pytest.raises(RunStopped, match=re.escape(f"algorithm Returns: loss() {said}")):
        train_one_batch(trainer)
    assert same(weights(trainer), before)


@pytest.mark.parametrize("max_grad_norm", [1.0, 0.0])  # 0: no clipping, the norm is still measured
def test_a_nan_loss_is_refused_before_the_update_and_leaves_the_weights_as_they_were(tiny_model, max_grad_norm):
    trainer = trainer_with(tiny_model, max_grad_norm=max_grad_norm)
    train_one_batch(trainer)
    trainer.step()  # a good step first: the refused one must leave this one's weights
    before, lr = weights(trainer), trainer.optimizer.param_groups[0]["lr"]
    adam = {k: v.clone() for k, v in trainer.optimizer.state[next(iter(trainer.model.parameters()))].items()}
    trainer.algorithm.poisoned = True
    train_one_batch(trainer, seed=1)
    with pytest.raises(NonFiniteStep) as caught:
        trainer.step()
    assert str(caught.value) == ("step 2: the loss is not finite (nan), so the update was not applied and nothing "
                                 "of this step was published or checkpointed; lower trainer.lr (now 0.01) or check "
                                 "the algorithm (NaNAfter)")
    assert same(weights(trainer), before) and trainer.version == 1
    assert trainer.optimizer.param_groups[0]["lr"] == lr
    after = trainer.optimizer.state[next(iter(trainer.model.parameters()))]
    assert all(torch.equal(adam[k], after[k]) for k in adam)  # AdamW's moments and step count untouched


@pytest.mark.parametrize("check", ["norm", "finite"])
def test_an_update_that_ruins_the_policy_is_refused_before_its_weights_go_anywhere(tiny_model, check):
    # finite gradients, a learning rate far too high: AdamW moves every weight by ~1e9, which is
    # finite, but ruins the policy -- the engines would find out first, in sampling, or a later
    # step's gradient. The weights' norm jumps (trainer.max_weight_change); with that check off,
    # the policy's outputs are not finite
    extra = {} if check == "norm" else {"max_weight_change": 1e30}
    trainer = trainer_with(tiny_model, algorithm=GRPO(GRPOConfig()), lr=1e9, **extra)
    train_one_batch(trainer)
    says = (r"changed the weights' norm from [\d.]+ to [\d.e+]+, more than trainer.max_weight_change = 1 of it"
            if check == "norm" else r"made the (weights|policy's log-probabilities) not finite")
    with pytest.raises(NonFiniteStep, match=rf"^step 1: the update {says} \(trainer.lr = 1e\+09\); nothing of this step "
                                            r"was published or checkpointed; lower trainer.lr or check the algorithm "
                                            r"\(GRPO\)$"):
        trainer.step()
    assert trainer.version == 0  # the step never finished: no export, no checkpoint waits on it


def test_max_nonfinite_steps_skips_a_few_in_a_row_and_stops_at_one_more(tiny_model):
    trainer = trainer_with(tiny_model, max_nonfinite_steps=1)
    before = weights(trainer)
    trainer.algorithm.poisoned = True
    train_one_batch(trainer)
    out = trainer.step()  # skipped: no update, the version still counted
    assert out["nonfinite_skipped"] == 1 and out["version"] == 1 and trainer.version == 1
    assert same(weights(trainer), before) and not trainer.optimizer.state
    assert all(p.grad is None for p in trainer.model.parameters())  # nothing carried into the next step
    trainer.algorithm.poisoned = False
    train_one_batch(trainer, seed=1)
    assert trainer.step()["nonfinite_skipped"] == 0 and not same(weights(trainer), before)  # and the count starts over
    trainer.algorithm.poisoned = True
    train_one_batch(trainer, seed=2)
    assert trainer.step()["nonfinite_skipped"] == 1
    train_one_batch(trainer, seed=3)
    with pytest.raises(NonFiniteStep, match=r"^step 4: the loss is not finite \(nan\) \(2 steps in a row; "
                                            r"trainer.max_nonfinite_steps = 1\), so the update was not applied"):
        trainer.step()


def test_a_checkpoint_holding_nan_weights_is_refused_at_load_so_they_are_never_published(tiny_model, tmp_path):
    # (written before steps that are not finite were refused)
    from streamrl.errors import RunFailed

    trainer = trainer_with(tiny_model)
    with torch.no_grad():
        next(iter(trainer.model.parameters()))[0, 0] = float("nan")
    trainer.save_checkpoint(str(tmp_path / "step-000003" / "trainer"))
    with pytest.raises(RunFailed, match=r"^checkpoint step-000003: its weights are not finite \(NaN or inf\); move "
                                        r".*step-000003 aside to resume from the checkpoint before it$"):
        trainer_with(tiny_model).load_checkpoint(str(tmp_path / "step-000003" / "trainer"))


# -- a real run -----------------------------------------------------------------------------------------
NAN_ALGORITHM = '''
from streamrl.algorithms.grpo import GRPO, GRPOConfig
from streamrl.api import Component, hookimpl


class NaNLater(GRPO):
    """GRPO until its loss has run 4 times (step 1's micro-batches), NaN after."""

    calls = 0

    def __init__(self, config):
        super().__init__(config)
        self.zero_advantage_no_gradient = False  # every sample reaches the loss, whatever its reward

    def loss(self, new, old, ref, adv, mask):
        per_sample, stats = super().loss(new, old, ref, adv, mask)
        self.calls += 1
        return (per_sample if self.calls <= 4 else per_sample * float("nan")), stats


@hookimpl
def register_algorithms():
    return [Component("algorithm", "nan_later", GRPOConfig, NaNLater)]
'''

BROKEN_REWARD = '''
from pydantic import BaseModel

from streamrl.api import Component, Reward, hookimpl


class Empty(BaseModel):
    pass


class Broken(Reward):
    def __init__(self, config):
        pass

    def score(self, prompt, response):
        raise KeyError("answer")


@hookimpl
def register_rewards():
    return [Component("reward", "broken", Empty, Broken)]
'''


CONSTANT_REWARD = BROKEN_REWARD.replace('raise KeyError("answer")', "return 0.25").replace('"broken", Empty, Broken',
                                                                                         '"constant", Empty, Broken')


PARITY_REWARD = BROKEN_REWARD.replace('raise KeyError("answer")', "return float(len(response) % 2 == 0)").replace(
    '"broken", Empty, Broken', '"parity", Empty, Broken')  # (rewards that differ within a group: real gradients)


def with_algorithm_or_reward(recipe: Path, name: str, code: str, section: str) -> Path:
    """``recipe`` with the recipe-local plugin ``code`` as its algorithm or its reward (``section``)."""
    if section == "reward":
        return with_plugin(recipe, name, code, replace=('name = "exact_match"', f'name = "{name}"'))
    return with_plugin(recipe, name, code, extra=f'\n[algorithm]\nname = "{name}"\n')


def error_lines(proc) -> list[str]:
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return [line for line in proc.stderr.splitlines() if line.startswith("streamrl: error")]


@pytest.mark.slow
def test_a_plugin_algorithm_returning_nan_stops_the_run_in_one_line_and_nothing_of_it_is_kept(tiny_recipe, tmp_path,
                                                                                              shared_cluster):
    recipe = with_algorithm_or_reward(tiny_recipe, "nan_later", NAN_ALGORITHM, "algorithm")
    proc = streamrl("recipe", "run", str(recipe), "--set", "run.steps=3", "--set", "run.checkpoint_every=1",
                    "--set", "run.mode=batch", *sets(*shared_cluster.sets), "--plain", "--no-report")
    assert proc.returncode == 1, proc.stderr[-3000:]
    (run,) = (tmp_path / "runs").iterdir()
    assert error_lines(proc) == [
        "streamrl: error: step 2: the loss is not finite (nan), so the update was not applied and nothing of this "
        "step was published or checkpointed; lower trainer.lr (now 0.001) or check the algorithm (NaNLater); the "
        f"last checkpoint is step-000001 (resume with: streamrl recipe resume {run}, --set to change the recipe)"]
    # the step after the last good one is in neither the checkpoints nor the metrics
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step-000001"]
    assert [r["step"] for r in read_records(run)] == [0]
    state = json.loads((run / "status.json").read_text())
    assert state["state"] == "failed" and state["error"].startswith("NonFiniteStep: step 2:")


@pytest.mark.slow
def test_a_reward_that_fails_for_every_sample_stops_the_run_in_one_line_with_its_error(tiny_recipe, tmp_path,
                                                                                       shared_cluster):
    recipe = with_algorithm_or_reward(tiny_recipe, "broken", BROKEN_REWARD, "reward")
    proc = streamrl("recipe", "run", str(recipe), "--set", "run.steps=3", *sets(*shared_cluster.sets), "--plain",
                    "--no-report")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert error_lines(proc) == [
        "streamrl: error: step 1: the reward failed for all 16 samples (the first: KeyError: 'answer'), so the "
        "step was not trained on; a reward that fails for every sample is a bug, not a learning signal: fix what the "
        "first error names; no checkpoint was written yet (run.checkpoint_every)"]
    (run,) = (tmp_path / "runs").iterdir()
    assert not (run / "metrics.jsonl").exists() or (run / "metrics.jsonl").read_text() == ""  # no step recorded
    assert not (run / "policy").exists()


@pytest.mark.slow
def test_a_run_whose_every_group_got_equal_rewards_is_warned_about_once(tiny_recipe, tmp_path, shared_cluster):
    recipe = with_algorithm_or_reward(tiny_recipe, "constant", CONSTANT_REWARD, "reward")
    proc = streamrl("recipe", "run", str(recipe), "--set", "run.steps=2", *sets(*shared_cluster.sets), "--plain",
                    "--no-report")
    assert proc.returncode == 0, proc.stderr[-3000:]
    warned = [line for line in proc.stderr.splitlines() if "all samples got the same reward" in line]
    assert len(warned) == 1 and warned[0].startswith("no learning signal at step 1: in every prompt's group"), \
        proc.stderr[-3000:]
    (run,) = (tmp_path / "runs").iterdir()
    assert [r["flat_groups"] for r in read_records(run)] == [1.0, 1.0]


@pytest.mark.slow
def test_a_learning_rate_far_too_high_stops_the_run_at_its_first_update_and_nothing_of_it_is_kept(tiny_recipe, tmp_path,
                                                                                                   shared_cluster):
    recipe = with_algorithm_or_reward(tiny_recipe, "parity", PARITY_REWARD, "reward")
    proc = streamrl("recipe", "run", str(recipe), "--set", "run.steps=3", "--set", "run.checkpoint_every=1",
                    "--set", "trainer.lr=1e9", *sets(*shared_cluster.sets), "--plain", "--no-report")
    assert proc.returncode == 1, proc.stderr[-3000:]
    # the update is finite, but it moves the weights' norm by orders of magnitude (trainer.max_weight_change)
    (line,) = error_lines(proc)
    assert re.fullmatch(r"streamrl: error: step 1: the update changed the weights' norm from [\d.]+ to [\d.e+]+, more "
                        r"than trainer.max_weight_change = 1 of it \(trainer.lr = 1e\+09\); nothing of this step was "
                        r"published or checkpointed; lower trainer.lr or check the algorithm \(GRPO\); no checkpoint "
                        r"was written yet \(run.checkpoint_every\)", line), line
    (run,) = (tmp_path / "runs").iterdir()
    assert not (run / "checkpoints").exists() or not list((run / "checkpoints").iterdir())
    assert not (run / "policy").exists()
    assert json.loads((run / "status.json").read_text())["state"] == "failed"


# -- validation --------------------------------------------------------------------------------------------
def validate(capsys, recipe: Path, *overrides: str) -> tuple[int, str]:
    code = main(["recipe", "validate", str(recipe), *[a for o in overrides for a in ("--set", o)]])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err.strip()


@pytest.mark.parametrize("algorithm", ["grpo", "rloo", "dr_grpo", "reinforce_pp", "dpo"])
def test_a_group_baseline_with_one_sample_per_prompt_is_refused_at_validation(capsys, tiny_recipe, algorithm):
    code, err = validate(capsys, tiny_recipe, "trainer.samples_per_prompt=1", f'algorithm.name="{algorithm}"')
    assert code == 2
    assert err == (f'streamrl: error: trainer.samples_per_prompt: 1 with algorithm.name = "{algorithm}", which '
                   "learns from the differences between a prompt's samples (a group baseline, or a preference "
                   "pair): a sample alone gets advantage 0 and nothing is learned; use 2 or more (8 is usual)")
    assert validate(capsys, tiny_recipe, "trainer.samples_per_prompt=2", f'algorithm.name="{algorithm}"')[0] == 0


ODD_EPOCHS = """
from streamrl.algorithms.grpo import GRPO, GRPOConfig
from streamrl.api import Component, hookimpl


class NoPasses(GRPO):
    def __init__(self, config):
        super().__init__(config)
        self.epochs = EPOCHS


@hookimpl
def register_algorithms():
    return [Component("algorithm", "no_passes", GRPOConfig, NoPasses)]
"""


@pytest.mark.parametrize("epochs", ["0", "2.5", "None"])
def test_an_algorithm_plugin_with_no_whole_number_of_epochs_is_refused_at_validation(capsys, tiny_recipe, epochs):
    recipe = with_plugin(tiny_recipe, "no_passes", ODD_EPOCHS.replace("EPOCHS", epochs),
                         extra='\n[algorithm]\nname = "no_passes"\n')
    code, err = validate(capsys, recipe)
    assert (code, err) == (2, f"streamrl: error: algorithm 'no_passes': its epochs is {epochs}; expected a whole number "
                              "of passes over each batch, 1 to 1000")
    recipe = with_plugin(tiny_recipe, "no_passes", ODD_EPOCHS.replace("EPOCHS", "3"),
                         extra='\n[algorithm]\nname = "no_passes"\n')
    assert validate(capsys, recipe)[0] == 0


def test_one_sample_per_prompt_is_fine_for_an_algorithm_with_a_critic(capsys, tiny_recipe):
    assert validate(capsys, tiny_recipe, "trainer.samples_per_prompt=1", 'algorithm.name="ppo"')[0] == 0


def test_max_new_tokens_past_the_models_positions_is_refused_at_validation(capsys, tiny_recipe, tiny_model):
    limit = json.loads((tiny_model / "config.json").read_text())["max_position_embeddings"]
    code, err = validate(capsys, tiny_recipe, "engine.max_new_tokens=100000000")
    assert code == 2
    assert err == (f"streamrl: error: engine.max_new_tokens: 100000000 does not fit the model's {limit} positions "
                   f"(max_position_embeddings in {tiny_model.resolve() / 'config.json'}), which the prompt and the "
                   f"response share; use less than {limit}")
    assert validate(capsys, tiny_recipe, f"engine.max_new_tokens={limit}")[0] == 2
    assert validate(capsys, tiny_recipe, f"engine.max_new_tokens={limit - 1}")[0] == 0
