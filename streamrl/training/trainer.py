"""The ``hf`` trainer: a transformers causal LM and AdamW on the train worker; forward/backward
per micro-batch, one optimizer step per batch.

Gradients of a batch accumulate over its micro-batches. Each micro-batch's loss is the sum of
per-sample losses times ``scale = 1 / samples in the batch``, so the accumulated gradient is the
same however the batch was cut into micro-batches and in whatever order they arrived -- which is
why ``stream`` and ``batch`` modes give the same update.

How the train pool holds the policy (one worker or ``ddp``: ``training/strategy.py``; ``fsdp``:
``training/fsdp.py``) and the precision it trains in (``training/precision.py``) are objects the
trainer is composed with, chosen once when it is built: the steps here do not branch on either.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path

import torch

from streamrl.api import Trainer, TrainerCapabilities, TrainerContext
from streamrl.contracts.learning import TrainerFootprint
from streamrl.devices import worker_device
from streamrl.errors import RunFailed, UpdateBroke
from streamrl.sample import Group, Sample
from streamrl.training import backward_pass, fsdp
from streamrl.training.critic import Critic
from streamrl.training import hf_config
from streamrl.training.hf_config import HFTrainerConfig
from streamrl.training.finite import FiniteGuard, all_finite, weight_norm
from streamrl.training.kernels import compile_layers, use_liger_kernels
from streamrl.models.tokenizers import load_tokenizer
from streamrl.training.logprobs import TokenLogprobs, naive_token_logprobs, pad_batch, pad_token
from streamrl.training.precision import precision_for
from streamrl.training.strategy import Replicated, Strategy
from streamrl.training.weights_bytes import weights_from_bytes, weights_to_bytes


token_logprobs = naive_token_logprobs  # the plain computation, for checks against an engine


def without_dropout(model: torch.nn.Module) -> None:
    """Turn the model's own dropout off (as TRL does by default), LoRA's ``trainer.lora.dropout``
    left as set: the engines sample without it, so with it on (GPT-2, OPT, Phi: 0.1) the
    trainer's log-probs of the very weights that sampled are noise away from the engine's -- a
    ratio off 1 on-policy, tokens clipped for nothing, a KL to the reference at step 0."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Dropout) and "lora_dropout" not in name:
            module.p = 0.0
        # (attention's own and a few architectures' others, read as floats in their forward)
        for attr in ("attention_dropout", "dropout", "hidden_dropout", "activation_dropout"):
            if isinstance(getattr(module, attr, None), float):
                setattr(module, attr, 0.0)


def _taking_turns(method):
    """A method of a trainer over a base it shares with other learners runs on its turn: the
    base held and its adapter the active one (``training/lora.py``'s ``SharedBase.turn``)."""
    @functools.wraps(method)
    def on_its_turn(self, *args, **kwargs):
        if self.lora is None or self.lora.shared is None:
            return method(self, *args, **kwargs)
        with self.lora.shared.turn(self.lora.name):
            return method(self, *args, **kwargs)
    return on_its_turn


class HFTrainer(Trainer):
    """A causal LM + AdamW (+ a frozen reference model and a critic when the algorithm asks),
    composed with a :class:`~streamrl.training.precision.Precision` (``trainer.precision``) and a
    :class:`~streamrl.training.strategy.Strategy` (one worker or ddp; fsdp) chosen at build."""

    @classmethod
    def capabilities(cls, config: HFTrainerConfig) -> TrainerCapabilities:
        """Data parallel over the train pool (``ddp``), and shardable (``fsdp``)."""
        return hf_config.capabilities(config)

    def __init__(self, config: HFTrainerConfig, context: TrainerContext, device: str | None = None):
        from streamrl.models import pretrained

        self.config = config
        self.algorithm = context.algorithm
        self.temperature = context.engine.temperature
        self.device = device or worker_device()
        lora_auto = config.lora is not None and config.precision == "auto" and self.device == "cuda"
        self.precision = precision_for("bf16-autocast" if lora_auto else config.precision, self.device)
        self.strategy: Strategy = fsdp.FSDP(self.device) if context.sharded else Replicated()
        built_on = self.strategy.build_device(self.device)
        torch.manual_seed(context.seed)
        self.tokenizer = load_tokenizer(context.model_path)  # (saved with the policy: as the engines encode)
        self.lora = None
        """With ``trainer.lora``: the LoRA policy (``training/lora.py``'s ``LoraPolicy``): its
        adapter's name, the base it may share with the worker's other learners, and whether a
        publication is the adapter alone."""
        if config.lora is not None:
            from streamrl.training import lora

            self.lora = lora.build(config.lora, str(context.model_path), str(built_on), context.learner or "",
                                   context.engine.adapters, self._prepare)
            self.model = self.lora.model
        else:
            self.model = pretrained.causal_lm(context.model_path, torch.float32).to(built_on)
        self.model.train()
        without_dropout(self.model)
        prepared = self.lora is not None and self.lora.prepared  # (a shared base: by its first learner)
        if config.kernels == "liger" and not prepared:
            use_liger_kernels(self.model, self.device)
        self.masters = self.strategy.masters(self.precision, self.model)
        if not prepared:
            self._prepare(self.model, kernels=False)
        self.reference = None
        if self.algorithm.needs_reference:
            # only ever run, never stepped: kept in the dtype the policy is kept in (bf16-params: bf16)
            dtype = next(self.model.parameters()).dtype
            self.reference = pretrained.causal_lm(context.model_path, dtype).to(built_on).eval()
            self.reference.requires_grad_(False)
            if config.kernels == "liger":
                use_liger_kernels(self.reference, self.device)
        self.critic = None
        if self.algorithm.needs_critic:
            self.critic = Critic(context.model_path, config.critic_lr, built_on, config.weight_decay)
            without_dropout(self.critic)  # (its values, against the first pass's, without noise either)
        # the policy's (and reference's) token log-probs, as modules: the unit fsdp shards
        self.policy = TokenLogprobs(self.model)
        self.reference_policy = TokenLogprobs(self.reference) if self.reference is not None else None
        self._build_optimizer()
        self.version = 0
        self.first = None  # what a step's first epoch computed, for its later ones (backward_pass.FirstPass)
        self._publish_bytes = self.publish_bytes()  # (fixed by the model and the adapter: once)
        self.optimizer.zero_grad(set_to_none=True)
        self.sharded = False  # trainer.strategy = "fsdp" over several ranks, once shard() has run
        self.finite = FiniteGuard(config.max_nonfinite_steps)  # (``training/finite.py``)
        self.probe = None
        """A sample this rank trained in this step: after the update, the new policy's
        log-probabilities of it must be finite before the weights go anywhere."""

    def _prepare(self, model: torch.nn.Module, kernels: bool = True) -> None:
        # the model settings: Liger's kernels, activation checkpointing, compiled layers (once
        # per model: a base shared by several learners is made ready by the first, under its lock)
        if kernels and self.config.kernels == "liger":
            use_liger_kernels(model, self.device)
        if self.config.activation_checkpointing:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        if self.config.compile:
            compile_layers(model)

    def own_parameters(self) -> list[torch.nn.Parameter]:
        """The parameters this trainer steps, and checks after a step: the policy's (sharded: its
        shards; bf16-params: the float32 masters), or on a base several LoRA learners share its
        own adapter's alone (the others' are their learners': one learner's broken adapter must
        not fail the others' checks)."""
        if self.lora is not None and self.lora.shared is not None:
            from streamrl.training.lora import own_parameters

            return own_parameters(self.model, self.lora.name)
        return list(self.stepped.parameters())

    def _build_optimizer(self) -> None:
        # AdamW over the policy's parameters as they are now, and its linear warm-up
        params = self.own_parameters()
        self.optimizer = torch.optim.AdamW(params, lr=self.config.lr, weight_decay=self.config.weight_decay)
        warmup = self.config.warmup_steps
        self.lr_schedule = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda i: min(1.0, (i + 1) / (warmup + 1)))

    @property
    def stepped(self) -> torch.nn.Module:
        """The module whose parameters AdamW steps and checkpoints hold: the float32 master copy
        under ``precision = "bf16-params"`` (unsharded), else the policy itself."""
        return self.masters.module

    def shard(self) -> None:
        """Shard policy, reference and critic over the train pool (``training/fsdp.py``); the
        optimizers are built anew over the sharded parameters (no step has been taken yet)."""
        compute = self.precision.compute_dtype  # the critic computes from its float32 weights
        units = [(self.policy, compute), (self.reference_policy, compute), (self.critic, None)]
        self.strategy.shard([(m, dtype) for m, dtype in units if m is not None], self.model)
        self._build_optimizer()
        if self.critic is not None:
            self.critic.optimizer = torch.optim.AdamW(self.critic.parameters(), lr=self.config.critic_lr,
                                                      weight_decay=self.config.weight_decay)
        self.sharded = True

    @_taking_turns
    def micro_batch(self, groups: list[Group], scale: float) -> dict:
        """Forward/backward on whole groups; gradients accumulate until :meth:`step`. Sharded,
        ``groups = []`` runs an empty pass (every rank must run as many passes as the others)."""
        try:
            out = backward_pass.empty(self) if not groups else backward_pass.of_groups(self, groups, scale)
            self.masters.accumulate()
            return out
        except torch.OutOfMemoryError:
            samples = [s for g in groups for s in g]
            longest = max((len(s.prompt_ids) + len(s.response_ids) for s in samples), default=0)
            free = ""
            if self.device == "cuda":
                free_b, total_b = torch.cuda.mem_get_info()
                free = f"; {free_b / 2**30:.1f} of {total_b / 2**30:.1f} GiB free"
            # (a sharded rank's empty pass, which only gathers the weights: no micro-batch to name)
            what = f"a micro-batch of {len(samples)} samples x {longest} tokens (padded)" if samples else \
                "an empty pass (gathering the sharded weights, no samples of its own)"
            raise RuntimeError(
                f"trainer: {what} ran out of "
                f"{self.device} memory{free}; lower trainer.micro_batch_tokens or groups_per_micro_batch, or set "
                "trainer.activation_checkpointing = true (one group alone must fit)") from None

    @_taking_turns
    def step(self) -> dict:
        """Clip, step the optimizer, clear gradients; the policy version goes up by one. Over a
        train pool of several workers the gradients are first summed over the ranks
        (``training/data_parallel.py``; sharded, in each backward), so every rank applies the
        one-worker update.

        Nothing that is not finite gets past it, on every rank alike: a loss or gradient norm
        that is not finite is no update (:class:`~streamrl.errors.NonFiniteStep`, or a skipped
        step under ``max_nonfinite_steps``), and after an update the weights and the new
        policy's log-probabilities of one of the step's samples are checked before the weights
        can be exported or checkpointed (both wait for this step)."""
        t0 = time.perf_counter()
        self.strategy.reduce_gradients([m for m in (self.stepped, self.critic) if m is not None])
        # (AdamW's parameters: with a shared base, another learner's gradients may be waiting there)
        trained = [p for group in self.optimizer.param_groups for p in group["params"]]
        norm = self.strategy.clip_grad_norm(trained, self.config.max_grad_norm)
        out = {"version": self.version + 1, "grad_norm": norm, "nonfinite_skipped": 0}
        if self.critic is not None:
            out["critic_grad_norm"] = self.critic.clip(self.strategy.clip_grad_norm, self.config.max_grad_norm)
        problem = self.finite.problem(self.strategy, self.device, norm, out.get("critic_grad_norm", 0.0))
        # a step that trained no sample (a serving run stopped before any rewarded traffic came):
        # no gradient anywhere, so nothing moves -- the learning-rate schedule neither
        learned = self.strategy.any_rank(any(p.grad is not None for p in trained), self.device)
        if problem is not None:
            # raises, unless max_nonfinite_steps lets this step be skipped
            self.finite.refuse(problem, self._step_name(), self.config.lr, type(self.algorithm).__name__)
            out["nonfinite_skipped"] = 1
        elif learned:
            self.finite.applied()
            checked = self.own_parameters()
            before = weight_norm(checked)
            # critic warm-up: the critic learns and the policy stays put -- its zero gradients
            # stepped AdamW all the same (weight decay, Adam's step count) and its schedule
            if not (self.critic is not None and self.version < self.algorithm.critic_warmup_steps):
                self.optimizer.step()
                self.lr_schedule.step()
            if self.critic is not None:
                self.critic.apply()
            self.masters.copy_back()
            # Finite gradients and a finite learning rate make finite weights, short of an
            # overflow; but an update far too large (trainer.lr = 1e9) makes finite weights whose
            # outputs are not, and the engines would be the first to find out, a step later, in
            # their sampling. The next thing done with the weights is to publish them: check them
            # (a pass over the weights) and the new policy's log-probabilities of one sample (a
            # forward pass of one sequence) first.
            broken = None
            after = weight_norm(checked) if before > 0 else 0.0
            if not all_finite(checked):
                broken = "made the weights not finite"
            elif before > 0 and abs(after - before) > self.config.max_weight_change * before:
                broken = (f"changed the weights' norm from {before:.4g} to {after:.4g}, more than "
                          f"trainer.max_weight_change = {self.config.max_weight_change:g} of it")
            elif not self._probe_finite():
                broken = "made the policy's log-probabilities not finite"
            if self.strategy.any_rank(broken is not None, self.device):
                raise UpdateBroke(f"{self._step_name()}: the update {broken or 'was not sane on another rank'} "
                                    f"(trainer.lr = {self.config.lr:g}); nothing of this step was published or "
                                    f"checkpointed; lower trainer.lr or check the algorithm "
                                    f"({type(self.algorithm).__name__})")
            self.strategy.weights_changed(self.model)
        self.optimizer.zero_grad(set_to_none=True)
        if self.critic is not None:
            self.critic.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        if self.first is not None:  # (algorithm.epochs > 1: backward_pass.FirstPass)
            if self.version % self.algorithm.epochs == 0:
                self.first = None  # the step's last epoch: the next batch starts over
            else:
                self.first.done = True
        out["publish_bytes"] = self._publish_bytes
        return {**out, "seconds": time.perf_counter() - t0}

    def _step_name(self) -> str:
        # the run's step as the console counts it (from 1): the version counts optimizer steps,
        # ``algorithm.epochs`` of them per step
        return f"step {self.version // max(1, self.algorithm.epochs) + 1}"

    @torch.no_grad()
    def _probe_finite(self) -> bool:
        """The updated policy's log-probabilities of this step's :attr:`probe` are finite (a
        rank that trained nothing probes a pad token: sharded, every rank's forward takes part)."""
        like, self.probe = self.probe, None
        pad = pad_token(self.tokenizer)
        if like is None:
            like = Sample(uid="probe", prompt=None, prompt_ids=[pad], response_ids=[pad], logprobs=[0.0])
        ids, attn, resp, _ = (t.to(self.device) for t in pad_batch([like], pad))
        with self.precision.autocast():
            new = self.policy(ids, attn, self.temperature, self.config.logprob_chunk_tokens, resp,
                              self.config.logprob_kernels)
        self.strategy.forward_only_done(self.policy)
        return bool(torch.isfinite(new[resp > 0]).all())

    @torch.no_grad()
    @_taking_turns
    def named_weights(self) -> dict[str, torch.Tensor]:
        """What a publication sends: the parameters, detached (tied weights once, as
        ``named_parameters`` gives them). Sharded: the whole weights gathered at the last step,
        on rank 0. A LoRA learner: its adapter alone when the engine holds adapters
        (``LoraPolicy.publishes_adapter``), else the merged weights under the plain model's names
        (``training/lora.py``)."""
        if self.lora is not None:
            from streamrl.training.lora import adapter_payload, merged_weights

            if self.lora.publishes_adapter:
                return adapter_payload(self.model, self.lora.name)
            return merged_weights(self.model, self.lora.name)
        return self.strategy.named_weights(self.model)

    def publish_bytes(self) -> int:
        """Bytes of one publication as trained (:meth:`named_weights`), from the tensors' sizes:
        the adapter's, or the whole model's (tied weights once)."""
        if self.lora is not None:  # the adapter, or the merged weights
            return sum(t.numel() * t.element_size() for t in self.named_weights().values())
        seen = {id(p): p for p in self.model.parameters()}
        return sum(p.numel() * p.element_size() for p in seen.values())

    @torch.no_grad()
    @_taking_turns
    def logprobs(self, group: Group) -> list[list[float]]:
        """Recomputed logprobs of each response's tokens under the current weights (for checks)."""
        self.strategy.alone("logprobs are not recomputed")
        ids, attn, resp, _ = pad_batch(group, pad_token(self.tokenizer))
        lp = token_logprobs(self.model, ids.to(self.device), attn.to(self.device), self.temperature).cpu()
        return [lp[i][resp[i] > 0].tolist() for i in range(len(group))]

    @_taking_turns
    def save_checkpoint(self, path: str) -> None:
        """Policy, AdamW, LR schedule, critic, algorithm state and RNGs (``training/trainer_state.py``)."""
        from streamrl.training import trainer_state

        trainer_state.save(self, path)

    @_taking_turns
    def load_checkpoint(self, path: str) -> None:
        """Restore a :meth:`save_checkpoint` folder in place."""
        from streamrl.training import trainer_state

        trainer_state.load(self, path)
        # a checkpoint written before steps that are not finite were refused may hold NaN
        # weights: they must not be published to the engines after a resume
        if self.strategy.any_rank(not all_finite(self.own_parameters()), self.device):
            raise RunFailed(f"checkpoint {Path(path).parent.name}: its weights are not finite (NaN or inf); "
                            f"move {Path(path).parent} aside to resume from the checkpoint before it")
        self.masters.copy_back()  # (bf16-params: the checkpoint holds the float32 masters)
        self.strategy.weights_changed(self.model)  # (sharded: the export after a resume sends these)

    @_taking_turns
    def save(self, out: str) -> str:
        """Write the current policy as a transformers model folder (``from_pretrained`` reloads it;
        bf16-params: the float32 masters). Sharded: every rank calls it (the weights are
        gathered), rank 0 writes."""
        if self.lora is not None:  # the merged model, and the adapter beside it
            from streamrl.training.lora import save_policy

            save_policy(self.lora, out)
            self.tokenizer.save_pretrained(out)
            if self.critic is not None:
                self.critic.save(f"{out}/critic", state_dict=self.strategy.full_state(self.critic))
            return out
        policy = self.strategy.full_state(self.stepped)
        critic = self.strategy.full_state(self.critic) if self.critic is not None else None
        if self.strategy.writes:
            self.stepped.save_pretrained(out, state_dict=policy)
            self.tokenizer.save_pretrained(out)
            if self.critic is not None:
                self.critic.save(f"{out}/critic", state_dict=critic)
        return out

    @_taking_turns
    def footprint(self) -> TrainerFootprint:
        """Device, precision, the policy's size and the training state this rank holds: the
        policy's and critic's parameters and their AdamW state, a shard's local part only."""
        from torch.distributed.tensor import DTensor

        def nbytes(t: torch.Tensor) -> int:
            t = t.to_local() if isinstance(t, DTensor) else t  # a shard: only what is here
            return t.numel() * t.element_size()

        modules = [m for m in (self.model, self.critic) if m is not None]
        optimizers = [self.optimizer] + ([self.critic.optimizer] if self.critic is not None else [])
        return TrainerFootprint(
            device=self.device, precision=self.precision.name, vocab_size=self.model.config.vocab_size,
            parameters=sum(p.numel() for p in self.model.parameters()),
            params_bytes=sum(nbytes(p) for m in modules for p in m.parameters()),
            optimizer_bytes=sum(nbytes(v) for o in optimizers for st in o.state.values() for v in st.values()
                                if isinstance(v, torch.Tensor) and v.dim() > 0))

__all__ = ["HFTrainer", "HFTrainerConfig", "pad_batch", "token_logprobs", "weights_to_bytes", "weights_from_bytes"]
