"""Memory-lean training paths, on CPU: chunked log-probs, bf16 autocast, devices per pool, and
the out-of-memory message. (The GPU figures are taken by ``streamrl bench`` on a GPU machine.)"""

from __future__ import annotations

import pytest
import torch

from streamrl.algorithms.grpo import GRPO, GRPOConfig
from streamrl.api import EngineCapabilities, TrainerContext
from streamrl.engines.hf import HFEngine, HFEngineConfig
from streamrl.sample import Prompt
from streamrl.errors import UserError
from streamrl.training import backward_pass
from streamrl.training.head_logprobs import head_logprobs
from streamrl.training.kernels import use_liger_kernels
from streamrl.training.logprobs import naive_token_logprobs, token_logprobs
from streamrl.training.trainer import HFTrainer, HFTrainerConfig, pad_batch


def trainer(model, **config):
    return HFTrainer(HFTrainerConfig(**{"lr": 1e-2, **config}), TrainerContext(str(model), GRPO(GRPOConfig()),
                                                                        EngineCapabilities(temperature=0.7)))


def sampled(model, n_prompts=6, n=4, temperature=0.7, dtype="float32"):
    """Real samples from the static-batching engine (its logprobs are the reference)."""
    engine = HFEngine(HFEngineConfig(max_new_tokens=6, temperature=temperature, batching="static", profile=False,
                                     dtype=dtype))
    engine.load(str(model))
    try:
        groups = engine.generate_groups([Prompt(uid=f"p{i}", text=f"{i}{i}+{7 - i}=", answer="") for i in range(n_prompts)],
                                        n, [0.0] * n_prompts)
    finally:
        engine.close()
    for g in groups:
        for k, s in enumerate(g):
            s.reward = float(k % 2)
    return groups


def assert_same_gradient(a, b, groups):
    """``a`` and ``b`` accumulate the same gradient on ``groups`` (up to float summation order)."""
    for t in (a, b):
        t.micro_batch(groups, 1 / 24)
    ga = {n: p.grad for n, p in a.model.named_parameters()}
    assert any(g.abs().max() > 1e-4 for g in ga.values())
    for n, p in b.model.named_parameters():
        assert torch.allclose(ga[n], p.grad, rtol=1e-4, atol=1e-7), n


def test_chunked_logprobs_equal_the_plain_ones_and_the_engines_and_never_hold_all_logits(tiny_model):
    t = trainer(tiny_model)
    groups = sampled(tiny_model)
    samples = [s for g in groups for s in g]
    ids, attn, resp, old = pad_batch(samples, t.tokenizer.pad_token_id)
    head_rows = []
    hook = t.model.get_output_embeddings().register_forward_hook(lambda m, i, o: head_rows.append(o.shape[:-1].numel()))
    chunked = token_logprobs(t.model, ids, attn, 0.7, chunk_tokens=5, mask=resp)
    hook.remove()
    plain = naive_token_logprobs(t.model, ids, attn, 0.7)
    assert (chunked - plain * resp).abs().max().item() < 1e-5  # equal on response tokens, 0 elsewhere
    assert ((chunked - old) * resp).abs().max().item() < 1e-5  # and equal to what the engine sampled with
    # the gradient is the same, and the head never saw more than one chunk of positions at once
    head_rows.clear()
    hook = t.model.get_output_embeddings().register_forward_hook(lambda m, i, o: head_rows.append(o.shape[:-1].numel()))
    (chunked * resp).sum().backward()  # recomputes each chunk's logits
    hook.remove()
    g_chunked = {n: p.grad.clone() for n, p in t.model.named_parameters()}
    t.model.zero_grad()
    (plain * resp).sum().backward()
    for n, p in t.model.named_parameters():
        assert torch.allclose(g_chunked[n], p.grad, atol=1e-5, rtol=1e-4), n
    assert head_rows and max(head_rows) <= 5 and sum(head_rows) == int(resp.sum())


def head_case(seed=0, n=37, hidden=16, vocab=300, dtype=torch.float32):
    """A random linear head, hidden states, targets and per-token loss weights."""
    torch.manual_seed(seed)
    head = torch.nn.Linear(hidden, vocab, bias=False, dtype=dtype)
    h = torch.randn(n, hidden, dtype=dtype, requires_grad=True)
    return head, h, torch.randint(0, vocab, (n,)), torch.randn(n)


def head_result(head, h, y, g, fn):
    """Log-probs and the gradients of ``sum(g * log-probs)`` for the hidden states and the head."""
    h.grad, head.weight.grad = None, None
    lp = fn()
    (lp * g).sum().backward()
    return lp.detach(), h.grad.clone(), head.weight.grad.clone()


@pytest.mark.parametrize("chunk", [1, 8, 37, 100])
def test_the_fused_head_gives_the_log_softmax_and_its_gradient_in_any_chunking(chunk):
    head, h, y, g = head_case()
    plain = head_result(head, h, y, g, lambda: torch.log_softmax(head(h), -1).gather(-1, y[:, None]).squeeze(-1))
    fused = head_result(head, h, y, g, lambda: head_logprobs(head, h, y, chunk, "eager"))
    for a, b in zip(fused, plain):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)
    # under bf16 autocast (what bf16-autocast training runs in) it stays within bf16 of fp32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = head_result(head, h, y, g, lambda: head_logprobs(head, h, y, chunk, "eager"))
    assert (low[0] - plain[0]).abs().max() < 0.1 and low[1].dtype == torch.float32
    assert (low[2] - plain[2]).abs().max() < 0.05 * plain[2].abs().max()


@pytest.mark.slow
def test_the_compiled_head_kernels_equal_the_eager_ones():
    # torch.compile on CPU (a C++ compiler builds the kernels): the reductions a GPU runs fused
    head, h, y, g = head_case(seed=1)
    eager = head_result(head, h, y, g, lambda: head_logprobs(head, h, y, 16, "eager"))
    compiled = head_result(head, h, y, g, lambda: head_logprobs(head, h, y, 16, "compiled"))
    for a, b in zip(compiled, eager):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kernels", ["checkpointed", "eager"])
def test_each_head_path_trains_like_the_plain_one(tiny_model, kernels):
    groups = sampled(tiny_model)
    a, b = trainer(tiny_model, logprob_chunk_tokens=0), trainer(tiny_model, logprob_chunk_tokens=7,
                                                                logprob_kernels=kernels)
    assert_same_gradient(a, b, groups)


def test_liger_kernels_where_they_cannot_run_are_one_line(tiny_model):
    with pytest.raises(UserError, match=r'trainer.kernels = "liger" needs a CUDA GPU; the train worker has cpu'):
        use_liger_kernels(torch.nn.Linear(2, 2), "cpu")


def test_liger_kernels_in_an_engine_where_they_cannot_run_are_one_line(tiny_model):
    from streamrl.engines.hf import HFEngine, HFEngineConfig

    engine = HFEngine(HFEngineConfig(batching="slots", kernels="liger", profile=False))
    with pytest.raises(UserError, match=r'engine.kernels = "liger" needs a CUDA GPU; the generate worker has cpu'):
        engine.load(str(tiny_model), device="cpu")


def test_trainer_gradient_is_the_same_with_and_without_chunks(tiny_model):
    groups = sampled(tiny_model)
    a, b = trainer(tiny_model, logprob_chunk_tokens=0), trainer(tiny_model, logprob_chunk_tokens=7)
    assert_same_gradient(a, b, groups)


def test_bf16_autocast_trains_near_fp32_and_keeps_fp32_master_weights(tiny_model):
    groups = sampled(tiny_model)
    full, mixed = trainer(tiny_model, precision="fp32"), trainer(tiny_model, precision="bf16-autocast")
    before = {n: p.clone() for n, p in full.named_weights().items()}
    for t in (full, mixed):
        t.micro_batch(groups, 1 / 24)
        t.step()
    wf, wm = full.named_weights(), mixed.named_weights()
    assert all(w.dtype == torch.float32 for w in wm.values())  # master weights and AdamW state fp32
    moved = max((wf[n] - before[n]).abs().max().item() for n in wf)
    assert moved > 1e-3
    # the same direction: on most weights the two updates agree within 10% of the step size
    close = [((wm[n] - wf[n]).abs() <= 0.1 * (wf[n] - before[n]).abs() + 1e-4).float().mean().item() for n in wf]
    assert sum(close) / len(close) > 0.9


def test_bf16_params_trains_near_fp32_from_float32_masters_that_keep_updates_bf16_would_lose(tiny_model, tmp_path):
    groups = sampled(tiny_model)
    full, lean = trainer(tiny_model, precision="fp32"), trainer(tiny_model, precision="bf16-params")
    before = {n: p.clone() for n, p in full.named_weights().items()}
    for t in (full, lean):
        t.micro_batch(groups[:3], 1 / 24)  # two micro-batches: gradients summed in float32
        t.micro_batch(groups[3:], 1 / 24)
        t.step()
    assert all(p.dtype == torch.bfloat16 for p in lean.model.parameters())  # what runs and is exported
    assert all(w.dtype == torch.bfloat16 for w in lean.named_weights().values())
    masters = dict(lean.stepped.named_parameters())
    assert all(p.dtype == torch.float32 for p in masters.values())
    assert all(v.dtype == torch.float32 for st in lean.optimizer.state.values() for v in st.values() if v.dim())
    wf = full.named_weights()
    close = [((masters[n] - wf[n]).abs() <= 0.1 * (wf[n] - before[n]).abs() + 2e-3).float().mean().item() for n in wf]
    assert sum(close) / len(close) > 0.9
    for n, p in lean.model.named_parameters():  # the bf16 policy is its masters, rounded
        assert torch.equal(p, masters[n].to(torch.bfloat16)), n

    # an update far below bf16's resolution at the weight's size is kept by the masters
    tiny = trainer(tiny_model, precision="bf16-params", lr=1e-7)
    start = {n: p.detach().clone() for n, p in tiny.stepped.named_parameters()}
    rounded = {n: p.detach().clone() for n, p in tiny.model.named_parameters()}
    for _ in range(3):
        tiny.micro_batch(groups, 1 / 24)
        tiny.step()
    name = "model.embed_tokens.weight"
    big = start[name].abs() > 1e-2  # where bf16's step (>= 6e-5) dwarfs 3 updates of ~1e-7
    master = dict(tiny.stepped.named_parameters())[name]
    assert (master != start[name])[big].float().mean() > 0.5  # the float32 masters moved ...
    bf16 = dict(tiny.model.named_parameters())[name]
    assert (bf16 != rounded[name])[big].float().mean() < 0.01  # ... by less than bf16 can show yet

    # a checkpoint holds the float32 masters: a resumed trainer continues from them exactly
    lean.save_checkpoint(str(tmp_path / "ck"))
    back = trainer(tiny_model, precision="bf16-params")
    back.load_checkpoint(str(tmp_path / "ck"))
    for n, p in back.stepped.named_parameters():
        assert torch.equal(p, masters[n]), n
    for n, p in back.model.named_parameters():
        assert torch.equal(p, dict(lean.model.named_parameters())[n]), n
    assert back.version == lean.version == 1


def test_a_bf16_engine_loads_and_its_logprobs_are_within_bf16_of_the_fp32_trainer(tiny_model):
    groups = sampled(tiny_model, dtype="bfloat16")
    t = trainer(tiny_model)
    samples = [s for g in groups for s in g]
    ids, attn, resp, old = pad_batch(samples, t.tokenizer.pad_token_id)
    with torch.no_grad():
        new = token_logprobs(t.model, ids, attn, 0.7, chunk_tokens=16, mask=resp)
    gap = ((new - old) * resp).abs().max().item()
    assert 0 < gap < 0.1  # not identical (bf16 really ran), within bf16 rounding


def test_activation_checkpointing_gives_the_same_gradient(tiny_model):
    groups = sampled(tiny_model)
    a, b = trainer(tiny_model), trainer(tiny_model, activation_checkpointing=True)
    assert_same_gradient(a, b, groups)


def test_device_auto_is_the_cpu_here_and_cuda_without_a_gpu_is_an_error(monkeypatch):
    from streamrl.devices import ENV, worker_device

    monkeypatch.delenv(ENV, raising=False)
    assert worker_device() == "cpu"  # no GPU on this machine
    monkeypatch.setenv(ENV, "cuda")
    with pytest.raises(RuntimeError, match="device = 'cuda' for this pool, but this worker sees no GPU"):
        worker_device()


def test_pools_hand_out_gpus_and_advertise_them(tiny_recipe):
    from streamrl.cluster.pool_workers import worker_spec
    from streamrl.recipe.recipe import load_recipe

    recipe = load_recipe(str(tiny_recipe), ["pools.generate.workers=2", 'pools.generate.cuda_visible_devices=["0","1","2","3"]',
                                            "pools.generate.gpus_per_worker=2", 'pools.train.cuda_visible_devices=["3"]',
                                            'pools.reward.device="cpu"']).recipe
    spec = {name: w["options"] for name, w in worker_spec(recipe).items()}
    assert spec["generate-0"]["env"]["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert spec["generate-1"]["env"]["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert spec["train-0"]["env"]["CUDA_VISIBLE_DEVICES"] == "3"  # may share a GPU with generate-1
    assert spec["generate-0"]["resources"]["GPU"] == 2 and spec["train-0"]["resources"]["GPU"] == 1
    assert "GPU" not in spec["reward-0"]["resources"] and spec["reward-0"]["env"]["STREAMRL_DEVICE"] == "cpu"
    assert spec["generate-0"]["env"]["STREAMRL_DEVICE"] == "auto"


def test_a_gpu_pool_gets_a_share_of_host_memory_by_workers_not_threads(tiny_recipe):
    # a one-thread GPU trainer beside a 64-thread generate pool: Dask's share by threads would
    # give it 1/65 of the host, less than CUDA's libraries need
    import psutil

    from streamrl.cluster.pool_workers import worker_spec
    from streamrl.recipe.recipe import load_recipe

    recipe = load_recipe(str(tiny_recipe), ['pools.train.device="cuda"', "pools.generate.threads=64",
                                            'pools.reward.memory_limit="3GiB"']).recipe
    spec = {name: w["options"] for name, w in worker_spec(recipe).items()}
    workers = len(spec)
    assert spec["train-0"]["memory_limit"] == psutil.virtual_memory().total // workers
    assert spec["generate-0"]["memory_limit"] == "auto"  # a CPU pool: Dask's own share
    assert spec["reward-0"]["memory_limit"] == "3GiB"  # set by hand: kept


def test_a_micro_batch_that_runs_out_of_memory_is_one_line_with_its_size(tiny_model, monkeypatch):
    # fake at the edge that cannot run here: the device's allocator failing
    t = trainer(tiny_model)
    groups = sampled(tiny_model, n_prompts=2)

    def oom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(t.model.get_decoder(), "forward", oom)
    with pytest.raises(RuntimeError) as err:
        t.micro_batch(groups, 1 / 8)
    msg = str(err.value)
    assert "\n" not in msg and "8 samples" in msg and "trainer.micro_batch_tokens" in msg
    # a sharded rank's empty pass (no groups of its own) that runs out: the same one line
    monkeypatch.setattr(backward_pass, "empty", oom)
    with pytest.raises(RuntimeError, match=r"^trainer: an empty pass .* ran out of cpu memory; lower"):
        t.micro_batch([], 1 / 8)


@pytest.mark.slow  # inductor compiles the decoder layers (~30 s on 2 cores)
def test_a_compiled_trainer_keeps_its_weight_names_and_gives_the_same_gradient(tiny_model):
    plain, compiled = trainer(tiny_model), trainer(tiny_model, compile=True)
    assert list(compiled.named_weights()) == list(plain.named_weights())  # publication and checkpoints unchanged
    assert_same_gradient(plain, compiled, sampled(tiny_model, n_prompts=2))


def test_auto_precision_is_bf16_params_on_a_gpu_and_fp32_on_the_cpu():
    from streamrl.training.precision import precision_for

    assert precision_for("auto", "cuda").name == "bf16-params"  # (built without touching a GPU)
    assert precision_for("auto", "cpu").name == "fp32"
    assert precision_for("bf16-autocast", "cuda").name == "bf16-autocast"
