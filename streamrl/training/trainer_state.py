"""The hf trainer's checkpoint: everything a resumed run needs to continue exactly.

Tensors (policy, AdamW moments, critic and its optimizer) go through
``torch.distributed.checkpoint`` (DCP), which loads in place into freshly built modules. With one
worker or ``ddp`` (identical ranks) rank 0 writes everything alone; sharded (``fsdp``) every rank
writes its shards at once, and every rank reads back its own. The small
non-tensor state (optimizer step counts live in DCP; the LR schedule, the trainer's optimizer-step
count, the algorithm's running statistics and the RNG states) goes to ``trainer.pt`` beside it.

Nothing of a checkpoint is unpickled with Python's full pickle: a run folder may be shared, copied
from elsewhere or written by someone else, and unpickling runs whatever code the file names.
``trainer.pt`` holds only tensors and plain values and is read with ``weights_only=True``; DCP's
own ``.metadata`` (a pickle of DCP's metadata classes) is read by :class:`SafeReader`, which
refuses every class but those, and the plain values DCP stores as bytes (AdamW's hyperparameters)
by :class:`SafePlanner` with ``weights_only=True``. Before a run resumes, the controller checks
every such file the same way (``checkpoints/folders.py``, ``refused``) and passes over a checkpoint
with one that does not load so.
"""

from __future__ import annotations

import functools
import io
import pickle
import random
import warnings
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

#: What DCP's ``.metadata`` pickle may name (module, class): DCP's metadata records, the path and
#: tensor-property types inside them. Anything else is refused before it is called.
_DCP_METADATA_GLOBALS = {
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"), ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
}
_DCP_METADATA_MODULE = "torch.distributed.checkpoint.metadata"


class RefusedGlobal(pickle.UnpicklingError):
    """DCP's ``.metadata`` names a function or class DCP's metadata is never made of."""


class _MetadataUnpickler(pickle.Unpickler):
    """Python's unpickler restricted to what DCP's metadata is made of."""

    def find_class(self, module: str, name: str):
        import torch.distributed.checkpoint.metadata as metadata

        if (module, name) in _DCP_METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == _DCP_METADATA_MODULE and isinstance(getattr(metadata, name, None), type):
            return getattr(metadata, name)  # (its dataclasses and the memory-format enum)
        raise RefusedGlobal(f"{module}.{name} is not part of DCP's metadata")


class SafeReader(FileSystemReader):
    """DCP's file reader, reading ``.metadata`` without running code (:class:`_MetadataUnpickler`)."""

    def read_metadata(self, *args, **kwargs):
        """DCP's ``read_metadata``, through the restricted unpickler."""
        from torch.distributed.checkpoint.metadata import StorageMeta

        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """DCP's load planner, reading the non-tensor values (stored as ``torch.save`` bytes) with
    ``weights_only=True``: they are plain numbers, tuples and strings."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        """``DefaultLoadPlanner.load_bytes`` with ``weights_only=True``."""
        from torch.distributed.checkpoint._traverse import set_element

        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def read_metadata(dcp_folder: Path):
    """DCP's metadata of ``dcp_folder``, read without running code (:class:`RefusedGlobal` when
    it names anything else)."""
    return SafeReader(str(dcp_folder)).read_metadata()


def unsafe_torch_file(path: Path) -> str | None:
    """None when ``path`` (a ``torch.save`` file) loads with ``weights_only=True``, else one
    phrase naming it: it holds something other than tensors and plain values, and unpickling
    it could run code."""
    try:
        with warnings.catch_warnings():  # (torch warns of a pickle protocol it did not write itself)
            warnings.simplefilter("ignore")
            torch.load(path, weights_only=True)
    except pickle.UnpicklingError:
        return (f"{path.name} holds objects other than tensors and plain values; it was refused, "
                "since loading it could run code")
    except Exception as exc:
        return f"{path.name} cannot be loaded ({type(exc).__name__})"
    return None


def _dcp():
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    return dcp, get_state_dict, set_state_dict


def _options(trainer, saved_keys=None):
    """What of the modules a checkpoint holds: everything, but for a LoRA learner whose base is
    the engines' (it publishes its adapter alone) only what it trains: the adapter and its AdamW
    state, the frozen base weights being the model folder's. Loading (``saved_keys``: the
    checkpoint's), a LoRA learner takes what the checkpoint holds: its adapter alone when the
    learner that wrote it published its adapter and this one publishes merged weights (a recipe
    learner resumed by ``learners add --resume``, placed as added ones are), the base from the
    same model folder either way."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    lora = trainer.lora is not None and trainer.lora.publishes_adapter
    if trainer.lora is not None and saved_keys is not None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        # (the base's weights are those a state of every parameter has and one of the trained
        # ones has not: any of them saved, the checkpoint holds the base)
        every = get_model_state_dict(trainer.stepped, options=StateDictOptions(ignore_frozen_params=False))
        trained = get_model_state_dict(trainer.stepped, options=StateDictOptions(ignore_frozen_params=True))
        lora = not any(f"policy.model.{k}" in saved_keys for k in every.keys() - trained.keys())
    return StateDictOptions(ignore_frozen_params=lora, strict=not lora)  # (strict: every key, frozen ones too)


def _modules(trainer) -> dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]]:
    out = {"policy": (trainer.stepped, trainer.optimizer)}  # (bf16-params: the float32 masters)
    if trainer.critic is not None:
        out["critic"] = (trainer.critic, trainer.critic.optimizer)
    return out


def _adapter(trainer, saved_keys=None) -> str | None:
    """The adapter whose parameters a LoRA learner's checkpoint names under peft's default name
    (:func:`_as_saved`); None for a trainer without one, and for a checkpoint written before
    checkpoints named it so (``saved_keys``: its keys; they hold the learner's own name), which
    is read under the names it was written with."""
    if trainer.lora is None:
        return None
    from streamrl.training.lora import ADAPTER, checkpoint_name

    name = trainer.lora.name
    if saved_keys is not None and name != ADAPTER:
        own = (k for k in saved_keys if ".lora_" in k and checkpoint_name(k, name) not in (None, k))
        if next(own, None) is not None:
            return None
    return name


def _as_saved(adapter: str | None, model_state: dict, optim_state: dict) -> tuple[dict, dict]:
    """A module's state dicts (``get_state_dict``'s) under the names its checkpoint uses: a
    LoRA learner's ``adapter`` under one name wherever it trains, and the other learners' adapters
    on a shared base left out (``training/lora.py``'s :func:`checkpoint_name`; None: as they are)."""
    if adapter is None:
        return model_state, optim_state
    name = _saved_names(adapter)
    model = {name(k): v for k, v in model_state.items() if name(k) is not None}
    optim = {**optim_state,
             "state": {name(k): v for k, v in optim_state.get("state", {}).items() if name(k) is not None},
             "param_groups": [{**g, "params": [name(p) for p in g["params"] if name(p) is not None]}
                              for g in optim_state.get("param_groups", [])]}
    return model, optim


def _saved_names(adapter: str):
    """A parameter's name in the checkpoint (None: not this learner's), worked out once per name
    (a module's and its optimizer's dicts name the same parameters)."""
    from streamrl.training.lora import checkpoint_name

    return functools.cache(lambda fqn: checkpoint_name(fqn, adapter))


def _as_held(adapter: str | None, saved: tuple[dict, dict], held: tuple[dict, dict]) -> tuple[dict, dict]:
    """The state dicts loaded under the checkpoint's names (:func:`_as_saved`) back under the
    module's own, for ``set_state_dict``; what the checkpoint does not hold of this module (the
    other learners' adapters) as the module holds it now."""
    if adapter is None:
        return saved
    (model_saved, optim_saved), (model_held, optim_held) = saved, held
    name = _saved_names(adapter)
    model = {k: model_saved[name(k)] if name(k) is not None else v for k, v in model_held.items()}
    state = {k: optim_saved["state"][name(k)] if name(k) is not None and name(k) in optim_saved["state"] else v
             for k, v in optim_held.get("state", {}).items()}
    # (the hyper-parameters as loaded, each group's parameters under the module's names)
    groups = [{**loaded, "params": mine["params"]}
              for loaded, mine in zip(optim_saved.get("param_groups", []), optim_held.get("param_groups", []))]
    return model, {**optim_held, "state": state, "param_groups": groups}


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
    # An optimizer that has not stepped yet has no state, and DCP's get_state_dict makes some by
    # stepping it at learning rate 0: Adam's count at 1, so the first real update ran with the
    # second's bias correction. Its state is given back empty, and a resume empties it too.
    modules = _modules(trainer)
    unused = [name for name, (_, optimizer) in modules.items() if not optimizer.state]
    for name, (module, optimizer) in modules.items():
        state[f"{name}.model"], state[f"{name}.optim"] = _as_saved(
            _adapter(trainer), *get_state_dict(module, optimizer, options=_options(trainer)))
    for name in unused:
        modules[name][1].state.clear()
    with warnings.catch_warnings():  # one process and no process group: DCP says so, loudly
        warnings.simplefilter("ignore")
        # no_dist: the ranks of a data-parallel train pool hold identical state; rank 0 writes it
        _unwrapped(lambda: dcp.save(state, checkpoint_id=str(folder / "dcp"), no_dist=not trainer.sharded))
    if _rank() == 0:  # (unsharded, the only rank asked to write)
        torch.save({"version": trainer.version, "lr_schedule": trainer.lr_schedule.state_dict(),
                    "algorithm": trainer.algorithm.state_dict(), "torch_rng": torch.get_rng_state(),
                    "python_rng": random.getstate(), "nonfinite_in_a_row": trainer.finite.in_a_row,
                    "optimizers_unused": unused},
                   folder / "trainer.pt")


def load(trainer, path: str) -> None:
    """Restore the state :func:`save` wrote into this (freshly built) trainer, in place."""
    dcp, get_state_dict, set_state_dict = _dcp()
    folder = Path(path)
    if not (folder / "dcp" / ".metadata").is_file():
        # (said here: DCP's loader logs a traceback for each place it looks, then fails anyway)
        raise FileNotFoundError(f"{folder.name}/dcp/.metadata is missing: not a trainer's saved state")
    state, held = {}, {}
    modules = _modules(trainer)
    saved_keys = read_metadata(folder / "dcp").state_dict_metadata
    adapter = _adapter(trainer, saved_keys)
    options = _options(trainer, saved_keys)
    for name, (module, optimizer) in modules.items():
        held[name] = get_state_dict(module, optimizer, options=options)
        state[f"{name}.model"], state[f"{name}.optim"] = _as_saved(adapter, *held[name])
    _same_dtypes(state, folder / "dcp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _unwrapped(lambda: dcp.load(state, storage_reader=SafeReader(str(folder / "dcp")), planner=SafePlanner(),
                                    no_dist=not trainer.sharded))
    for name, (module, optimizer) in modules.items():
        model_state, optim_state = _as_held(adapter, (state[f"{name}.model"], state[f"{name}.optim"]), held[name])
        set_state_dict(module, optimizer, model_state_dict=model_state, optim_state_dict=optim_state,
                       options=options)
    extra = torch.load(folder / "trainer.pt", weights_only=True)  # (tensors and plain values only)
    trainer.version = extra["version"]
    trainer.lr_schedule.load_state_dict(extra["lr_schedule"])
    trainer.algorithm.load_state_dict(extra["algorithm"])
    torch.set_rng_state(extra["torch_rng"])
    random.setstate(extra["python_rng"])
    trainer.finite.in_a_row = extra.get("nonfinite_in_a_row", 0)  # (absent from older checkpoints)
    for name in extra.get("optimizers_unused", ()):  # (saved before its first step: as it was, empty)
        if name in modules:
            modules[name][1].state.clear()
    _recipe_learning_rates(trainer)


def _same_dtypes(state: dict, dcp_folder: Path) -> None:
    """Each weight of the trainer as saved: DCP copies a saved tensor into its target with a cast,
    so weights saved in bfloat16 and resumed into float32 (or the other way round) came back
    rounded, or with their float32 masters gone, without a word. Raises naming the first."""
    saved = read_metadata(dcp_folder).state_dict_metadata
    for part, held in state.items():
        if not part.endswith(".model"):
            continue
        for fqn, tensor in held.items():
            meta = saved.get(f"{part}.{fqn}")
            dtype = getattr(getattr(meta, "properties", None), "dtype", None)
            if dtype is not None and isinstance(tensor, torch.Tensor) and dtype != tensor.dtype:
                raise ValueError(f"{fqn} was saved as {str(dtype).removeprefix('torch.')} and this trainer holds it "
                                 f"as {str(tensor.dtype).removeprefix('torch.')} (trainer.precision or the model's "
                                 "dtype changed since)")


def _recipe_learning_rates(trainer) -> None:
    """The learning rates (and weight decay) of the recipe as resumed, not of the checkpoint: AdamW's param groups
    and the schedule's base rates come back from the checkpoint, so ``--set trainer.lr=...`` on
    a resume (what a run stopped by a loss that was not finite is told to do) would be ignored.
    With the run's own recipe this changes nothing: the schedule gives the very same rate."""
    schedule = trainer.lr_schedule
    schedule.base_lrs = [trainer.config.lr for _ in schedule.base_lrs]
    rates = [base * fn(schedule.last_epoch) for base, fn in zip(schedule.base_lrs, schedule.lr_lambdas)]
    for group, lr in zip(trainer.optimizer.param_groups, rates):
        group["initial_lr"], group["lr"] = trainer.config.lr, lr
        group["weight_decay"] = trainer.config.weight_decay
    schedule._last_lr = rates
    if trainer.critic is not None:
        for group in trainer.critic.optimizer.param_groups:
            group["lr"], group["weight_decay"] = trainer.config.critic_lr, trainer.config.weight_decay
