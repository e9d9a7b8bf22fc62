"""One component of every kind, written against ``streamrl.api`` and the built-ins that
docs/plugins.md names as extension points. Used as a recipe-local module by
tests/test_contracts.py, so it also checks that every kind reaches the workers by value."""

from __future__ import annotations

import json
import random
import threading
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field

from streamrl.api import (Algorithm, Assignment, Component, Engine, MetricSink, Prompt, Ranker, Reward, Sample,
                          Scheduler, Task, ToolParser, Transfer, hookimpl)
from streamrl.training.trainer import HFTrainer, HFTrainerConfig


class Empty(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SumsConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    seed: int = 0


class Sums(Task):
    """``a+b=`` prompts with one-digit operands."""

    alphabet = "0123456789+="

    def __init__(self, config: SumsConfig):
        self.config = config

    def prompts(self, step, n):
        rng = random.Random(self.config.seed * 1000 + step)
        out = []
        for i in range(n):
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            out.append(Prompt(uid=f"{step}-{i}", text=f"{a}+{b}=", answer=str(a + b)))
        return out


class LastDigit(Reward):
    """1 for the exact answer, 0.5 when only the last digit is right."""

    def __init__(self, config):
        self.config = config

    def score(self, prompt, response):
        if response.strip() == prompt.answer:
            return 1.0
        return 0.5 if response.strip()[-1:] == prompt.answer[-1:] else 0.0


class PlainConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    max_new_tokens: int = Field(4, ge=1)


class PlainGenerate(Engine):
    """The simplest engine: ``model.generate`` per group, one group at a time."""

    def __init__(self, config: PlainConfig):
        self.config = config
        self.lock = threading.Lock()

    def load(self, model_path):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path).eval()

    @torch.no_grad()
    def generate(self, prompt, n, priority=0.0):
        ids = [self.tok.bos_token_id] + self.tok(prompt.text, add_special_tokens=False).input_ids
        with self.lock:
            version = self.version
            out = self.model.generate(torch.tensor([ids] * n), do_sample=True, top_k=0, top_p=1.0, temperature=1.0,
                                      max_new_tokens=self.config.max_new_tokens, output_scores=True,
                                      return_dict_in_generate=True, pad_token_id=self.tok.pad_token_id,
                                      eos_token_id=self.tok.eos_token_id)
        new = out.sequences[:, len(ids):]
        logp = torch.stack([s.log_softmax(-1) for s in out.scores], 1).gather(-1, new[..., None])[..., 0]
        group = []
        for k in range(n):
            resp = new[k].tolist()
            if self.tok.eos_token_id in resp:  # keep the EOS, drop the padding after it
                resp = resp[:resp.index(self.tok.eos_token_id) + 1]
            group.append(Sample(uid=f"{prompt.uid}-{k}", prompt=prompt, prompt_ids=ids, response_ids=resp,
                                logprobs=logp[k, :len(resp)].tolist(), policy_version=version,
                                response_text=self.tok.decode(resp, skip_special_tokens=True)))
        return group

    @torch.no_grad()
    def load_weights(self, named_tensors, version):
        with self.lock:
            for name, p in self.model.named_parameters():
                p.copy_(named_tensors[name])
            self.version = version


class Reinforce(Algorithm):
    """REINFORCE with a group-mean baseline and a token-level loss (constant normaliser)."""

    def __init__(self, config):
        self.config = config

    def advantages(self, rewards):
        mean = sum(rewards) / len(rewards)
        return [r - mean for r in rewards]

    def loss(self, new, old, ref, adv, mask):
        per_sample = -(adv[:, None] * new * mask).sum(-1) / 4.0  # 4 = the generation budget
        ratio = torch.exp(new - old)
        return per_sample, {"mean_ratio_sum": ((ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1)).sum().detach()}


class SGDConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lr: float = 0.05


class SGDTrainer(HFTrainer):
    """The hf trainer with plain SGD instead of AdamW."""

    def __init__(self, config: SGDConfig, context):
        super().__init__(HFTrainerConfig(lr=config.lr), context)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=config.lr)
        self.lr_schedule = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda i: 1.0)


class NumpyTransfer(Transfer):
    """Weights as numpy arrays carried by Dask."""

    def __init__(self, config):
        self.config = config

    def send(self, weights, version):
        return {n: t.detach().cpu().numpy() for n, t in weights.items()}

    def receive(self, payload, version):
        return {n: torch.from_numpy(a) for n, a in payload.items()}


class RewardsFileConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    file: str = "rewards.txt"


class RewardsFile(MetricSink):
    def __init__(self, config: RewardsFileConfig):
        self.config = config

    def open(self, run_dir):
        self.path = Path(run_dir) / self.config.file

    def write(self, record):
        with self.path.open("a") as f:
            f.write(json.dumps({"step": record["step"], "reward": record["reward_mean"]}) + "\n")


class TextLength(Ranker):
    def __init__(self, config):
        self.config = config
        self.seen = 0

    def predict(self, prompts):
        return [float(len(p.text)) for p in prompts]

    def observe(self, prompts, lengths):
        self.seen += len(prompts)


class Reverse(Scheduler):
    """Prompts go to the workers in reverse order; predicted-longest first."""

    def __init__(self, config):
        self.config = config
        self.placed = 0

    def dispatch(self, prompts, scores, workers, ctx):
        self.placed = len(prompts)
        return [Assignment(i, workers[::-1][i % len(workers)], priority=scores[i]) for i in range(len(prompts))]

    def metrics(self):
        return {"placed": self.placed}


class CallLineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prefix: str = "CALL "


class CallLine(ToolParser):
    """A reply line ``<prefix>name {json arguments}`` is a tool call (``prefix``: an option)."""

    def __init__(self, config: CallLineConfig):
        self.start = config.prefix

    def parse(self, text):
        calls, kept = [], []
        for line in text.splitlines():
            name, _, args = line.removeprefix(self.start).partition(" ")
            if line.startswith(self.start) and name:
                calls.append({"name": name, "arguments": args or "{}"})
            else:
                kept.append(line)
        return ("\n".join(kept) or None) if calls else text, calls


@hookimpl
def register_tasks():
    return [Component("task", "sums", SumsConfig, Sums)]


@hookimpl
def register_rewards():
    return [Component("reward", "last_digit", Empty, LastDigit)]


@hookimpl
def register_engines():
    return [Component("engine", "plain", PlainConfig, PlainGenerate)]


@hookimpl
def register_algorithms():
    return [Component("algorithm", "reinforce", Empty, Reinforce)]


@hookimpl
def register_trainers():
    return [Component("trainer", "sgd", SGDConfig, SGDTrainer)]


@hookimpl
def register_transfers():
    return [Component("transfer", "numpy", Empty, NumpyTransfer)]


@hookimpl
def register_metric_sinks():
    return [Component("metric_sink", "rewards_file", RewardsFileConfig, RewardsFile)]


@hookimpl
def register_rankers():
    return [Component("ranker", "text_length", Empty, TextLength)]


@hookimpl
def register_schedulers():
    return [Component("scheduler", "reverse", Empty, Reverse)]


@hookimpl
def register_tool_parsers():
    return [Component("tool_parser", "call_line", CallLineConfig, CallLine)]
