"""The slot decoder's GPU sampling kernels (``engines/fused_sampling.py``), run on this CPU
through Triton's interpreter in a process of their own (``fused_sampling_check.py``: the
interpreter must be chosen before the kernels are defined): the draws follow the tempered
softmax, greedy rows take the argmax, log-probs equal torch's, and the slot decoder's step with
the kernels decodes as with its torch ops."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.slow


def test_the_kernels_draw_from_the_tempered_softmax_with_the_trainers_logprobs(tmp_path):
    pytest.importorskip("triton")
    from streamrl.tasks.arch import random_model

    model = tmp_path / "qwen-small"
    random_model("qwen2.5-0.5b", str(model), dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=512),
                 dtype="float32")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "fused_sampling_check.py"), str(model)], env=env,
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["logprob_absdiff_max"] < 1e-5 and found["decoder_logprob_absdiff_max"] < 1e-4
    assert sum(found["counts"]) == 240 and found["chi2"] < 13.8


def test_a_cpu_decoder_samples_with_torch_ops(tmp_path):
    """The kernels are a GPU's: asked for on a CPU, the decoder keeps its torch ops."""
    import torch
    from transformers import AutoModelForCausalLM

    from streamrl.engines.slot_decoder import SlotDecoder
    from streamrl.tasks.arch import random_model

    model = tmp_path / "qwen-small"
    random_model("qwen2.5-0.5b", str(model), dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                                                  num_attention_heads=2, num_key_value_heads=1, vocab_size=128),
                 dtype="float32")
    m = AutoModelForCausalLM.from_pretrained(str(model)).eval()
    dec = SlotDecoder(m, slots=2, context=8, max_new_tokens=4, temperature=1.0, stop_ids=(), graphs=False, fused=True)
    assert dec.fused is False
    dec.prefill([(0, [1, 2], 4, False)])
    dec.step(1)
    assert int(dec.generated[0]) == 2 and torch.isfinite(dec.out_logprobs[0, :2]).all()
