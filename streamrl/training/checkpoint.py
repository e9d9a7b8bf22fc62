"""The hf trainer's checkpoint: everything a resumed run needs to continue exactly.

Tensors (policy, AdamW moments, critic and its optimizer) go through
``torch.distributed.checkpoint`` (DCP), which loads in place into freshly built modules. With one
worker or ``ddp`` (identical ranks) rank 0 writes everything alone; sharded (``fsdp``) every rank
writes its shards at once, and every rank reads back its own. The small
non-tensor state (optimizer step counts live in DCP; the LR schedule, the trainer's optimizer-step
count, the algorithm's running statistics and the RNG states) goes to ``trainer.pt`` beside it.
"""

from __future__ import annotations

import random
import warnings
from pathlib import Path

import torch


def _dcp():
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    return dcp, get_state_dict, set_state_dict


def _modules(trainer) -> dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]]:
    out = {"policy": (trainer.stepped, trainer.optimizer)}  # (bf16-params: the float32 masters)
    if trainer.critic is not None:
        out["critic"] = (trainer.critic, trainer.critic.optimizer)
    return out


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _unwrapped(call):
    """Run ``call()``; DCP's ``CheckpointException`` (a ``BaseException`` whose text is every
    rank's traceback) becomes the first rank's own error -- the ``OSError`` of a full disk, a
    truncated file's -- so that it travels back from the worker as what it is."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        return call()
    except CheckpointException as exc:
        first = next(iter(exc.failures.values()), None)
        cause = first[0] if isinstance(first, tuple) and first else None
        if isinstance(cause, Exception):
            raise cause.with_traceback(None) from None
        raise RuntimeError(f"torch.distributed.checkpoint failed on ranks {sorted(exc.failures)}") from None


def save(trainer, path: str) -> None:
    """Write the trainer's full state into the folder ``path`` (created)."""
    dcp, get_state_dict, _ = _dcp()
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    state = {}
    for name, (module, optimizer) in _modules(trainer).items():
        state[f"{name}.model"], state[f"{name}.optim"] = get_state_dict(module, optimizer)
    with warnings.catch_warnings():  # one process and no process group: DCP says so, loudly
        warnings.simplefilter("ignore")
        # no_dist: the ranks of a data-parallel train pool hold identical state; rank 0 writes it
        _unwrapped(lambda: dcp.save(state, checkpoint_id=str(folder / "dcp"), no_dist=not trainer.sharded))
    if _rank() == 0:  # (unsharded, the only rank asked to write)
        torch.save({"version": trainer.version, "lr_schedule": trainer.lr_schedule.state_dict(),
                    "algorithm": trainer.algorithm.state_dict(), "torch_rng": torch.get_rng_state(),
                    "python_rng": random.getstate(), "nonfinite_in_a_row": trainer.nonfinite_in_a_row},
                   folder / "trainer.pt")


def load(trainer, path: str) -> None:
    """Restore the state :func:`save` wrote into this (freshly built) trainer, in place."""
    dcp, get_state_dict, set_state_dict = _dcp()
    folder = Path(path)
    state = {}
    modules = _modules(trainer)
    for name, (module, optimizer) in modules.items():
        state[f"{name}.model"], state[f"{name}.optim"] = get_state_dict(module, optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _unwrapped(lambda: dcp.load(state, checkpoint_id=str(folder / "dcp"), no_dist=not trainer.sharded))
    for name, (module, optimizer) in modules.items():
        set_state_dict(module, optimizer, model_state_dict=state[f"{name}.model"],
                       optim_state_dict=state[f"{name}.optim"])
    extra = torch.load(folder / "trainer.pt", weights_only=False)
    trainer.version = extra["version"]
    trainer.lr_schedule.load_state_dict(extra["lr_schedule"])
    trainer.algorithm.load_state_dict(extra["algorithm"])
    torch.set_rng_state(extra["torch_rng"])
    random.setstate(extra["python_rng"])
    trainer.nonfinite_in_a_row = extra.get("nonfinite_in_a_row", 0)  # (absent from older checkpoints)
    _recipe_learning_rates(trainer)


def _recipe_learning_rates(trainer) -> None:
    """The learning rates of the recipe as resumed, not of the checkpoint: AdamW's param groups
    and the schedule's base rates come back from the checkpoint, so ``--set trainer.lr=...`` on
    a resume (what a run stopped by a loss that was not finite is told to do) would be ignored.
    With the run's own recipe this changes nothing: the schedule gives the very same rate."""
    schedule = trainer.lr_schedule
    schedule.base_lrs = [trainer.config.lr for _ in schedule.base_lrs]
    rates = [base * fn(schedule.last_epoch) for base, fn in zip(schedule.base_lrs, schedule.lr_lambdas)]
    for group, lr in zip(trainer.optimizer.param_groups, rates):
        group["initial_lr"], group["lr"] = trainer.config.lr, lr
    schedule._last_lr = rates
    if trainer.critic is not None:
        for group in trainer.critic.optimizer.param_groups:
            group["lr"] = trainer.config.critic_lr
