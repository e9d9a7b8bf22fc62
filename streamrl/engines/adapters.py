"""LoRA adapters in an engine: many over one copy of the base weights, each request with its own.

A LoRA learner publishes its adapter, not the model (``contracts/adapters.py``). The engine keeps
its base weights as loaded and adds each adapted layer's low-rank term at run time, through a
forward hook on the layer (the model's modules and parameter names stay as they are, so a full
weight load still copies into them):

    y = base(x) + scale[k] * (x @ A[k].T) @ B[k].T

where ``k`` is the adapter of the row (the request) being computed. Every adapted layer keeps
its adapters stacked, ``A: [capacity + 1, rank, in]``, ``B: [capacity + 1, out, rank]``, with
index 0 all zeros (the base model alone), so a batch of rows with different adapters is one
gather and two batched matrix products per layer, and a step of the slot decoder is one CUDA
graph whatever adapters its requests use: the stacks and the per-row index have fixed addresses,
a load copies into them. Adapters of lower rank than the stack are zero-padded (exact: the
padding adds nothing).

:class:`AdapterBank` owns the stacks and names the adapters (the served policy is
:data:`POLICY`; a learner's variant goes by the learner's name). What rows use is set by the
caller around a forward (:meth:`AdapterBank.rows`): one adapter for every row (the static and
continuous batchings, greedy evaluation) or one per row (the slot decoder).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from streamrl.contracts import adapters as payload
from streamrl.errors import WeightShapeMismatch

#: The adapter of the run's served policy (what a LoRA learner's publication loads into).
POLICY = "policy"

#: How an unloaded adapter's index is held (``AdapterBank.unload``): not a name a learner can have.
_RETIRED = "(unloaded) "


class AdapterBank:
    """The adapters one engine holds over ``model``'s base weights: at most ``capacity``, by name."""

    def __init__(self, model: torch.nn.Module, capacity: int):
        self.model, self.capacity = model, capacity
        self.slots: dict[str, int] = {POLICY: 1} if capacity else {}
        """Adapter name -> its index in every layer's stack (1..capacity; 0 is the base). The
        served policy's is 1 from the start, so a request admitted before its first load follows
        it (its zero stacks are the base, as a weight load mid-response is seen by the next step)."""
        self.versions: dict[str, int] = {}
        """Adapter name -> the policy version loaded into it."""
        self.rank = 0
        self.layers: dict[str, dict[str, torch.Tensor]] = {}
        """Adapted layer -> its stacks ``A``, ``B``, ``scale``."""
        self._hooks = []
        self._rows: torch.Tensor | int | None = None  # None: every row the policy's adapter
        self._groups: list[tuple[int, torch.Tensor | None]] | None = None  # (CPU: rows grouped by adapter)
        self.layout = 0
        """Goes up whenever the stacks are allocated anew (a new layer or a higher rank): a
        captured graph that reads the old ones must be captured again."""

    # -- what rows use ---------------------------------------------------------------------------

    def slot(self, name: str, busy: frozenset[int] = frozenset()) -> int:
        """The index of adapter ``name``, kept for it from now on: a request for an adapter not
        yet published runs on the base (the index's zero stacks) and follows its first load, as
        a request follows a weight load; 0 (the base for good) when every index is taken.
        ``busy``: the indices running requests decode with; an unloaded adapter's index is given
        to another only once none does (they would go on with the new adapter's weights)."""
        if name not in self.slots:
            free = sorted(set(range(1, self.capacity + 1)) - set(self.slots.values()))
            if not free:  # an unloaded adapter's index no request uses, the longest unloaded
                retired = [n for n in self.slots if n.startswith(_RETIRED) and self.slots[n] not in busy]
                if not retired:
                    return 0
                free = [self.slots.pop(retired[0])]
            self.slots[name] = free[0]
        return self.slots[name]

    @contextmanager
    def rows(self, which: torch.Tensor | int):
        """Within: every forward adds adapter ``which`` (an index) to every row, or, for a
        ``[rows]`` tensor of indices, each row's own adapter. Outside any: every row gets
        :data:`POLICY`'s (the base alone before it is loaded)."""
        before = self._rows, self._groups
        self._rows, self._groups = which, None
        if isinstance(which, torch.Tensor) and which.device.type == "cpu":
            # On a CPU, a batch whose rows use one adapter (or none) computes that adapter's
            # low-rank product on its rows alone: gathering every row's A and B copies more than
            # the products compute (it halved decode throughput). Rows of several adapters keep
            # the gather: one small product per adapter and layer, each with its own copy of the
            # rows, was slower still (docs/benchmarks.md has the three). A GPU always gathers,
            # which a CUDA graph can capture (grouping reads the indices back).
            groups: dict[int, list[int]] = {}
            for i, k in enumerate(which.tolist()):
                if k:
                    groups.setdefault(k, []).append(i)
            if len(groups) <= 1:
                self._groups = [(k, None if len(idx) == len(which) else torch.tensor(idx))
                                for k, idx in groups.items()]
        try:
            yield
        finally:
            self._rows, self._groups = before

    def _hook(self, layer: str):
        def add_adapter(module, args, out):
            stacks = self.layers[layer]
            if self._groups is not None:  # (a CPU batch of one adapter: its rows on their own)
                x = args[0]
                for k, idx in self._groups:
                    a, b, s = stacks["A"][k], stacks["B"][k], stacks["scale"][k]
                    if idx is None:  # every row this one adapter's
                        out = out + ((x @ a.T) @ b.T * s).to(out.dtype)
                    else:
                        out = out.index_add(0, idx, ((x[idx] @ a.T) @ b.T * s).to(out.dtype))
                return out
            rows = self._rows if self._rows is not None else self.slots.get(POLICY, 0)
            if isinstance(rows, int):
                if rows == 0:
                    return out
                a, b, s = stacks["A"][rows], stacks["B"][rows], stacks["scale"][rows]
                return out + ((args[0] @ a.T) @ b.T * s).to(out.dtype)
            x = args[0]
            flat = x.reshape(x.shape[0], -1, x.shape[-1])  # [rows, tokens, in]
            a, b = stacks["A"][rows], stacks["B"][rows]  # [rows, rank, in], [rows, out, rank]
            delta = torch.bmm(torch.bmm(flat, a.transpose(1, 2)), b.transpose(1, 2))
            # (scaled in float32, as the trainer's alpha / rank is: rounded to bf16 first, a scale
            # such as 16 / 12 moved the engine's log-probs off the trainer's)
            delta = (delta.float() * stacks["scale"][rows][:, None, None]).to(out.dtype)
            return out + delta.reshape(out.shape)
        return add_adapter

    # -- loading ---------------------------------------------------------------------------------

    @torch.no_grad()
    def load(self, name: str, named: dict[str, torch.Tensor], version: int,
             busy: frozenset[int] = frozenset()) -> None:
        """Put adapter publication ``named`` into adapter ``name`` (a free index the first time,
        one of ``busy`` never: running requests decode with those; refused past ``capacity``).
        Checked whole before anything is copied, so a bad publication leaves every adapter as it
        was."""
        if version < self.versions.get(name, -1):
            return  # (a late load of an older version: the newer one stays)
        layers = payload.by_layer(named)
        modules = dict(self.model.named_modules())
        rank = 0
        for layer, (a, b, s) in layers.items():
            module = modules.get(layer)
            if not isinstance(module, torch.nn.Linear):
                raise WeightShapeMismatch(f"adapter {name!r} for version {version}: the model has no linear layer "
                                          f"{layer!r} (was it trained on another model?)")
            if a.dim() != 2 or b.dim() != 2 or a.shape[1] != module.in_features or b.shape[0] != module.out_features \
                    or a.shape[0] != b.shape[1]:
                raise WeightShapeMismatch(
                    f"adapter {name!r} for version {version}: layer {layer!r} is {module.out_features}x"
                    f"{module.in_features} in the engine, but A is {tuple(a.shape)} and B {tuple(b.shape)}")
            if s.numel() != 1 or not all(t.is_floating_point() for t in (a, b, s)):
                raise WeightShapeMismatch(f"adapter {name!r} for version {version}: layer {layer!r}'s scale is "
                                          f"{tuple(s.shape)} {s.dtype} (a single float) or A or B is not floating")
            if not all(bool(torch.isfinite(t).all()) for t in (a, b, s)):
                raise ValueError(f"adapter {name!r} for version {version}: layer {layer!r} holds NaN or infinite "
                                 "values; the adapter held is kept")
            rank = max(rank, a.shape[0])
        live = sorted(n for n in self.slots if not n.startswith(_RETIRED))  # (an unloaded one's index is free)
        if name not in self.slots and len(live) >= self.capacity:
            raise ValueError(f"the engine holds {self.capacity} adapters ({', '.join(live)}); "
                             f"adapter {name!r} is one more (engine.adapters)")
        self._make_room(layers, rank, modules)
        k = self.slot(name, busy)
        if k == 0:  # (index 0 is the base every row without an adapter reads: never written)
            raise ValueError(f"adapter {name!r} for version {version}: every index of the engine's {self.capacity} "
                             "is held by an adapter or by requests of an unloaded one still decoding; it loads once "
                             "they end")
        for layer, stacks in self.layers.items():
            if layer in layers:
                a, b, s = layers[layer]
                r = a.shape[0]
                stacks["A"][k].zero_()
                stacks["B"][k].zero_()
                stacks["A"][k, :r].copy_(a)
                stacks["B"][k, :, :r].copy_(b)
                stacks["scale"][k] = float(s)
            else:  # a layer this adapter leaves alone
                stacks["A"][k].zero_()
                stacks["B"][k].zero_()
        self.versions[name] = version

    def _make_room(self, layers: dict, rank: int, modules: dict) -> None:
        """Stacks for every layer of ``layers`` of at least ``rank``: new layers get stacks and a
        hook, a higher rank re-allocates every stack (the adapters held are kept). All of them
        are made before any is swapped in: an allocation that fails (device memory) leaves the
        bank as it was, not some layers at the new rank and the captured graphs reading freed
        stacks."""
        grow = rank > self.rank
        new = [layer for layer in layers if layer not in self.layers]
        if not grow and not new:
            return
        rank = max(rank, self.rank)
        made = {}
        for layer in [*self.layers, *new] if grow else new:
            module = modules[layer]
            w = module.weight
            old = self.layers.get(layer)
            stacks = {"A": torch.zeros(self.capacity + 1, rank, module.in_features, dtype=w.dtype, device=w.device),
                      "B": torch.zeros(self.capacity + 1, module.out_features, rank, dtype=w.dtype, device=w.device),
                      # (float32: alpha / rank as the trainer computes it, not rounded to bf16)
                      "scale": torch.zeros(self.capacity + 1, dtype=torch.float32, device=w.device)}
            if old is not None:
                stacks["A"][:, :self.rank].copy_(old["A"])
                stacks["B"][:, :, :self.rank].copy_(old["B"])
                stacks["scale"].copy_(old["scale"])
            made[layer] = stacks
        self.layers.update(made)
        for layer in new:
            self._hooks.append(modules[layer].register_forward_hook(self._hook(layer)))
        self.rank = rank
        self.layout += 1

    def unload(self, name: str) -> None:
        """Forget adapter ``name``: its index is zeroed (a request still decoding with it goes on
        on the base) and given to another adapter only when no index was never used."""
        k = self.slots.pop(name, None)
        self.versions.pop(name, None)
        if k is None:
            return
        self.slots[f"{_RETIRED}{name}-{k}"] = k
        for stacks in self.layers.values():
            stacks["A"][k].zero_()
            stacks["B"][k].zero_()
            stacks["scale"][k] = 0

    def remove(self) -> None:
        """Take every hook off the model (the engine is the base model again)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks, self.layers, self.versions, self.rank = [], {}, {}, 0
        self.slots = {POLICY: 1} if self.capacity else {}
