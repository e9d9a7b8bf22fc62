"""The critic of PPO: a value model trained beside the policy on the train worker.

A second copy of the policy's transformer (``AutoModel.from_pretrained`` of the same folder, so
it starts from the warm-started features) with a scalar head initialised to zero, and its own
AdamW. ``values(ids, attn)[b, t]`` is the value of the state whose next token is ``t + 1``:
aligned with the policy's token logprobs and the response mask.
"""

from __future__ import annotations

from typing import Callable

import torch


class Critic(torch.nn.Module):
    """Transformer backbone + linear value head, with its optimizer."""

    def __init__(self, model_path: str, lr: float, device: str = "cpu", weight_decay: float = 0.0):
        super().__init__()
        from streamrl.models import pretrained

        self.backbone = pretrained.backbone(model_path, torch.float32)
        self.head = torch.nn.Linear(self.backbone.config.hidden_size, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)
        self.to(device).train()
        self.optimizer = torch.optim.AdamW(self.parameters(), lr=lr, weight_decay=weight_decay)

    def values(self, ids, attn):
        """Values ``[B, T-1]`` of the states before each next token."""
        return self(ids, attn)  # through forward: a sharded critic gathers its weights there

    def forward(self, ids, attn):
        """See :meth:`values`."""
        hidden = self.backbone(input_ids=ids, attention_mask=attn).last_hidden_state[:, :-1]
        # (a copy, not a view of the head's output: FSDP warns that a view can lose its hooks)
        return self.head(hidden).squeeze(-1).float().clone()

    def clip(self, clip_grad_norm: Callable[..., float], max_grad_norm: float) -> float:
        """Clip with the trainer strategy's ``clip_grad_norm(params, max_grad_norm)`` (which
        gathers a sharded norm); returns the gradient norm. The trainer checks it is finite
        before :meth:`apply`."""
        return clip_grad_norm(self.parameters(), max_grad_norm)

    def apply(self) -> None:
        """Step the critic's optimizer and clear its gradients."""
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def save(self, out: str, state_dict: dict | None = None) -> None:
        """The backbone as a transformers folder, the head as ``value_head.pt`` beside it.
        ``state_dict``: this module's whole state, when its parameters are sharded."""
        state = state_dict if state_dict is not None else self.state_dict()
        self.backbone.save_pretrained(out, state_dict={k[len("backbone."):]: v for k, v in state.items()
                                                       if k.startswith("backbone.")})
        torch.save({k[len("head."):]: v for k, v in state.items() if k.startswith("head.")}, f"{out}/value_head.pt")


@torch.no_grad()
def critic_stats(values, returns, mask, value_loss) -> dict:
    """Per-sample sums for the record: the value loss, and the critic's explained variance of
    the returns over this micro-batch's response tokens (weighted by its samples)."""
    v, r = values[mask > 0], returns[mask > 0]
    var = r.var(unbiased=False) if r.numel() > 1 else torch.tensor(0.0)
    ev = 1.0 - (r - v).var(unbiased=False) / var if var > 1e-8 else torch.tensor(0.0)
    n = mask.shape[0]
    return {"value_loss_sum": value_loss.sum(), "explained_variance_sum": ev * n,
            "value_mean_sum": ((values * mask).sum(-1) / mask.sum(-1).clamp(min=1)).sum()}
