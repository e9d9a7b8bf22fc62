"""The ``hf`` trainer's backward pass over a micro-batch: the loss of whole groups, and its gradient.

Each sample's loss is scaled by ``scale = 1 / samples in the batch``, so gradients accumulated
over a batch's micro-batches add up to the same update however the batch was cut. A sharded
trainer's ranks must make the same collectives in every pass, so a rank with nothing to train
runs :func:`empty` instead: through every sharded module, adding exactly zero.
"""

from __future__ import annotations

import numbers
import os
import time
import traceback
from pathlib import Path

import torch

from streamrl.algorithms.off_policy import TOKEN_FLAGS
from streamrl.errors import RunStopped
from streamrl.sample import Group, Sample
from streamrl.training.critic import critic_stats
from streamrl.training.logprobs import pad_batch, pad_token
from streamrl.training.off_policy_stats import bucket_sums, token_versions
from streamrl.telemetry.text import message_line


def called(algorithm, method: str, *args):
    """``algorithm.method(*args)``. One that raises stops the run in one line naming the
    algorithm, the method, the error and where in the code it was raised
    (:class:`~streamrl.errors.RunStopped`: the step's optimizer step never runs, so nothing of it
    is applied), not in a traceback from the train worker. Running out of device memory is
    not the algorithm's mistake and goes up as it is."""
    try:
        return getattr(algorithm, method)(*args)
    except (RunStopped, torch.OutOfMemoryError):
        raise
    except Exception as exc:
        frames = [f for f in traceback.extract_tb(exc.__traceback__)[1:] if f"{os.sep}torch{os.sep}" not in f.filename]
        where = ""
        if frames:  # (a recipe-local plugin's code comes by value, without its file's name: its module's)
            f = frames[-1]
            name = Path(f.filename).name if not f.filename.startswith("<") else type(algorithm).__module__
            where = f" (at {name}:{f.lineno}, in {f.name})"
        raise RunStopped(f"algorithm {type(algorithm).__name__}: {method}() raised {type(exc).__name__}: "
                         f"{message_line(exc, 300)}{where}; nothing of this step was applied") from None


def loss_result(algorithm, result, batch: int) -> tuple[torch.Tensor, dict]:
    """What ``algorithm.loss`` returned, checked before the backward pass: ``(per_sample,
    stats)`` with ``per_sample`` a tensor of ``batch`` losses that carries a gradient, and
    ``stats`` a dict (None: none) of numbers or one-element tensors (its token flags aside).
    Anything else stops the run in one line naming the algorithm
    (:class:`~streamrl.errors.RunStopped`: nothing of the step is applied), not in a traceback
    from the backward pass or the record."""
    said = f"algorithm {type(algorithm).__name__}: loss()"
    try:
        per_sample, stats = result
    except (TypeError, ValueError):
        raise RunStopped(f"{said} returned {type(result).__name__}; expected (per-sample losses [B], stats dict); "
                         "nothing of this step was applied") from None
    if not isinstance(per_sample, torch.Tensor) or tuple(per_sample.shape) != (batch,):
        shape = tuple(per_sample.shape) if isinstance(per_sample, torch.Tensor) else type(per_sample).__name__
        raise RunStopped(f"{said} returned per-sample losses of shape {shape}; expected ({batch},), one per sample; "
                         "nothing of this step was applied")
    if torch.is_grad_enabled() and not per_sample.requires_grad:
        raise RunStopped(f"{said} returned losses without a gradient (computed from `old` or `ref`, or detached?); "
                         "they must come from `new`; nothing of this step was applied")
    stats = {} if stats is None else stats
    if not isinstance(stats, dict):
        raise RunStopped(f"{said} returned stats of type {type(stats).__name__}; expected a dict; "
                         "nothing of this step was applied")
    for key, value in stats.items():
        if key == TOKEN_FLAGS:
            continue
        one = (isinstance(value, numbers.Real) and not isinstance(value, bool)) or (
            isinstance(value, torch.Tensor) and value.numel() == 1)  # (numpy's scalars are Reals)
        if not one:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise RunStopped(f"{said} returned the stat {str(key)[:80]!r} as {shape}; expected one number "
                             "(a sum over the micro-batch's samples); nothing of this step was applied")
    return per_sample, dict(stats)


def rollouts(group: Group) -> list[list[int]]:
    """The positions of ``group``'s samples by rollout, in order. An agent's rollout split into
    segments is one rollout: its segments' uids are the first one's with ``.1``, ``.2``, ...
    after it (``agents/rollout.py``), each with the rollout's reward."""
    out: list[list[int]] = []
    first: dict[str, int] = {}
    for i, s in enumerate(group):
        base, dot, j = str(s.uid).rpartition(".")
        if dot and j.isdigit() and base in first:
            out[first[base]].append(i)
        else:
            first[str(s.uid)] = len(out)
            out.append([i])
    return out


def advantages(algorithm, group: Group) -> list[float]:
    """The algorithm's advantages of ``group``: one number per sample, or the run stops in one
    line naming the algorithm. A list of another length would still make tensors of matching
    shapes -- samples paired with other samples' advantages, or a group left out as if its
    advantages were zero -- and train on that without a word. The algorithm is given one reward
    per rollout (a split rollout counted once, not once per segment: in RLOO's or GRPO's
    baseline its segments would otherwise be each other's), and its segments share the
    rollout's advantage (with ``pairs``, its last segment alone)."""
    parts = rollouts(group)
    given = called(algorithm, "advantages", [group[p[0]].reward for p in parts])
    try:
        values = [float(a) for a in given]
    except (TypeError, ValueError):
        values = None
    if values is None or len(values) != len(parts):
        what = f"{len(values)} numbers" if values is not None else f"{type(given).__name__} {str(given)[:60]!r}"
        of = f"{len(group)} samples" if len(parts) == len(group) else f"{len(parts)} rollouts ({len(group)} samples)"
        raise RunStopped(f"algorithm {type(algorithm).__name__}: advantages() gave {what} for a group of "
                         f"{of}; expected one number per {'sample' if len(parts) == len(group) else 'rollout'}, "
                         "so nothing of this step was applied")
    out = [0.0] * len(group)
    last_only = getattr(algorithm, "pairs", False)
    for part, value in zip(parts, values):
        for i in part[-1:] if last_only else part:
            out[i] = value
    return out


class FirstPass:
    """What the first pass over a step's batch computed, by sample, for the later epochs
    (``algorithm.epochs`` above 1): each group's advantages (a running normaliser such as
    REINFORCE++'s sees each group once, and every epoch trains the same advantages), and with a
    critic the values, advantages and returns of each response token (PPO's value clip bounds the
    critic's move from the first pass's values, not from its own)."""

    def __init__(self):
        self.values: dict[str, object] = {}
        self.done = False
        """Whether the first pass is over (its optimizer step taken): the later ones read it."""


def first_pass(trainer) -> FirstPass | None:
    """The trainer's :class:`FirstPass` of this step (None with one epoch: nothing to keep)."""
    if getattr(trainer.algorithm, "epochs", 1) <= 1:
        return None
    if trainer.first is None:
        trainer.first = FirstPass()
    return trainer.first


def of_groups(trainer, groups: list[Group], scale: float) -> dict:
    """One micro-batch of whole groups: advantages (the algorithm's, or the critic's, which
    learns in the same pass), the loss and its backward, gradients accumulating until the
    trainer's step; returns what was trained and the statistics for the step's record."""
    t0 = time.perf_counter()
    samples = [s for g in groups for s in g]
    counted = {"samples": len(samples), "tokens": sum(len(s.response_ids) for s in samples),
               "reward_sum": float(sum(s.reward for s in samples))}
    adv_list = None
    kept = first_pass(trainer)
    if trainer.critic is None:
        adv_list = []
        for g in groups:
            if kept is not None and kept.done and all(s.uid in kept.values for s in g):
                adv_list += [kept.values[s.uid] for s in g]  # (a later epoch: the first pass's)
            else:
                given = advantages(trainer.algorithm, g)
                adv_list += given
                if kept is not None and not kept.done:
                    kept.values.update((s.uid, a) for s, a in zip(g, given))
        if trainer.algorithm.zero_advantage_no_gradient and trainer.version >= trainer.algorithm.critic_warmup_steps:
            # a sample with advantage 0 adds nothing to the gradient: leave it out of the
            # forward/backward (GRPO groups whose samples all got the same reward)
            keep = [i for i, a in enumerate(adv_list) if a != 0.0]
            if not keep:  # (sharded, every rank must still take part: a zero-loss pass)
                trainer.strategy.without_gradient(lambda: empty(trainer, samples[0]), trainer.model.parameters())
                return {**counted, "skipped_sum": counted["samples"], "loss_sum": 0.0,
                        "seconds": time.perf_counter() - t0}
            samples, adv_list = [samples[i] for i in keep], [adv_list[i] for i in keep]
    skipped = counted["samples"] - len(samples)
    # (each response token's log-prob under the policy that generated it: the ratio's old side;
    # without them the batch's tensors would not line up, a shape error naming nothing)
    short = next((s for s in samples if len(s.logprobs or ()) != len(s.response_ids)), None)
    if short is not None:
        raise RunStopped(f"trainer: sample {short.uid!r} has {len(short.response_ids)} response tokens and "
                         f"{len(short.logprobs or ())} log-probs; this trainer needs the generating engine's log-prob "
                         "of each (a simulated engine gives none: its samples train with trainer.name = \"sim\"); "
                         "nothing of this step was applied")
    trainer.probe = samples[0]
    ids, attn, resp, old = pad_batch(samples, pad_token(trainer.tokenizer))
    ids, attn, resp, old = (t.to(trainer.device) for t in (ids, attn, resp, old))
    stats: dict = {}
    critic_loss = 0.0
    if trainer.critic is None:
        adv = torch.tensor(adv_list, dtype=torch.float32, device=trainer.device)
    else:  # token-level advantages from the critic; the critic learns in the same micro-batch
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32, device=trainer.device)
        with trainer.precision.autocast():
            values = trainer.critic.values(ids, attn).float()
        spans = [slice(len(s.prompt_ids) - 1, len(s.prompt_ids) - 1 + len(s.response_ids)) for s in samples]
        if kept is not None and kept.done and all(s.uid in kept.values for s in samples):
            # a later epoch: the first pass's values, advantages and returns -- what the value clip
            # bounds the critic's move from, and the advantages PPO computes once per batch
            old_values, adv, returns = values.detach().clone(), torch.zeros_like(values), torch.zeros_like(values)
            for i, (s, span) in enumerate(zip(samples, spans)):
                old_values[i, span], adv[i, span], returns[i, span] = kept.values[s.uid]
        else:
            old_values = values.detach()
            adv, returns = called(trainer.algorithm, "token_advantages", rewards, old_values, resp)
            if kept is not None and not kept.done:
                kept.values.update((s.uid, (old_values[i, span].clone(), adv[i, span].clone(), returns[i, span].clone()))
                                   for i, (s, span) in enumerate(zip(samples, spans)))
        value_loss = called(trainer.algorithm, "value_loss", values, old_values, returns, resp)
        critic_loss = value_loss.sum() * scale
        stats = critic_stats(values.detach(), returns, resp, value_loss.detach())
    new, ref = policy_logprobs(trainer, ids, attn, resp)
    per_sample, algo_stats = loss_result(trainer.algorithm, called(trainer.algorithm, "loss", new, old, ref, adv, resp),
                                         ids.shape[0])
    flags = algo_stats.pop(TOKEN_FLAGS, None)
    stats.update(algo_stats)
    # how off-policy these tokens were, by staleness (versions count steps, not optimizer steps)
    current = trainer.version // max(1, trainer.algorithm.epochs)
    staleness = (current - token_versions(samples, ids.shape[1]).to(trainer.device)).clamp(min=0)
    off_policy = bucket_sums(new, old, resp, staleness, flags)
    if trainer.version < trainer.algorithm.critic_warmup_steps:
        per_sample = per_sample * 0.0  # critic warm-up: the policy does not move yet
    loss = per_sample.sum()
    (loss * scale + critic_loss).backward()
    loss_sum = float(loss.item())
    trainer.finite.saw_losses(loss_sum, float(stats.get("value_loss_sum", 0.0)))  # (the step refuses them)
    return {
        **counted,
        "skipped_sum": skipped,  # metrics.jsonl: "skipped", the share left out of the backward
        "loss_sum": loss_sum,
        "seconds": time.perf_counter() - t0,
        "offpolicy": off_policy,
        **{k: float(v) for k, v in stats.items()},
    }

def policy_logprobs(trainer, ids, attn, resp):
    """The policy's (with grad) and the reference's log-probs of the response tokens."""
    # policy (with grad) and reference log-probs of the response tokens, in this order:
    # sharded, the real and the empty passes must make the same collectives
    chunk = trainer.config.logprob_chunk_tokens
    with trainer.precision.autocast():
        new = trainer.policy(ids, attn, trainer.temperature, chunk, resp, trainer.config.logprob_kernels)
        ref = None
        if trainer.reference is not None:
            with torch.no_grad():
                ref = trainer.reference_policy(ids, attn, trainer.temperature, chunk, resp, trainer.config.logprob_kernels)
            # (sharded: FSDP keeps the root's weights gathered after a forward, for a backward that
            # never comes to the frozen reference -- a whole copy of them held until the next pass)
            trainer.strategy.forward_only_done(trainer.reference_policy)
    return new, ref

def empty(trainer, like=None) -> dict:
    """A pass that trains nothing but takes part in the ranks' collectives (below)."""
    # A forward/backward through every sharded module with a zero loss: it takes part in
    # the ranks' collectives and adds exactly zero to every gradient. ``like``: a sample to
    # copy the shape of (else one pad token of prompt and response).
    t0 = time.perf_counter()
    pad = pad_token(trainer.tokenizer)
    prompt, response = (like.prompt_ids, like.response_ids) if like is not None else ([pad], [pad])
    dummy = Sample(uid="pad", prompt=None, prompt_ids=prompt, response_ids=response,
                   logprobs=[0.0] * len(response), reward=0.0)
    ids, attn, resp, old = (t.to(trainer.device) for t in pad_batch([dummy], pad))
    critic_loss = 0.0
    if trainer.critic is None:
        adv = torch.zeros(1, device=trainer.device)
    else:
        with trainer.precision.autocast():
            values = trainer.critic.values(ids, attn).float()
        adv = torch.zeros_like(values)
        critic_loss = values.sum() * 0.0
    new, ref = policy_logprobs(trainer, ids, attn, resp)
    per_sample, _ = loss_result(trainer.algorithm, called(trainer.algorithm, "loss", new, old, ref, adv, resp), 1)
    (per_sample.sum() * 0.0 + critic_loss).backward()
    return {"samples": 0, "tokens": 0, "reward_sum": 0.0, "skipped_sum": 0, "loss_sum": 0.0,
            "seconds": time.perf_counter() - t0}
