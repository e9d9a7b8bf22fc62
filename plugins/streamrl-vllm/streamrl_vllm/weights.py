"""Loading a new policy into a running vLLM engine, in place.

``reload_weights`` (run on vLLM's worker through ``collective_rpc``) takes checkpoint-named
tensors -- the names ``model.named_parameters()`` gives in transformers, which is what every
streamrl transport delivers -- and re-runs vLLM's post-load processing for the layers it loaded.

The trap: on CPU, vLLM pre-packs linear weights for its GEMM kernels. A model with a *tied*
``lm_head`` has no ``lm_head.weight`` of its own in the checkpoint, so the reload refreshes the
embedding but the lm_head keeps the packed copy of the *old* weights: the engine then samples
from a mix of two policies and its logprobs drift from the trainer's (by up to 0.34 on the tiny
addition model). So after the reload the lm_head is re-packed from the new embedding. On a GPU
there is no packed copy and nothing to do.
"""

from __future__ import annotations


def _repack_lm_head(worker) -> None:
    # runs on vLLM's worker (in this process): rebuild the packed GEMM weight of the tied lm_head
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    dispatch_cpu_unquantized_gemm(worker.model_runner.get_model().lm_head, remove_weight=False)


def swap_weights(llm, named_tensors: dict, tied: bool, on_cpu: bool) -> None:
    """Load ``named_tensors`` into ``llm`` in place; re-pack a tied lm_head on CPU; drop the prefix
    cache (its keys were computed by the old policy; running requests recompute theirs)."""
    items = [(name, t.detach().to("cpu")) for name, t in named_tensors.items()]
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(items)})
    if tied and on_cpu:
        llm.collective_rpc(_repack_lm_head)
    llm.llm_engine.reset_prefix_cache(reset_running_requests=True)
