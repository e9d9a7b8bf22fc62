"""Run by ``test_fused_sampling.py`` in a process of its own with ``TRITON_INTERPRET=1``: the
fused sampling kernels on a CPU through Triton's interpreter (which must be set before the
kernels are defined), against torch's log-softmax and argmax, and inside the slot decoder.
Prints one JSON line of what it found; every check is also an assert."""

from __future__ import annotations

import json
import math
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

from streamrl.engines import fused_sampling as fs  # noqa: E402


def chunked_logprobs_and_argmax() -> dict:
    """Several chunks (the last one partial), greedy and sampled rows, a temperature."""
    torch.manual_seed(0)
    logits = (torch.randn(4, 2500) * 4).to(torch.bfloat16)
    greedy = torch.tensor([True, False, True, False])
    seed = fs.new_seed("cpu")
    before = int(seed)
    tok, lp = fs.sample(logits, greedy, 0.7, seed, chunk=1024)
    ref = torch.log_softmax(logits.float() / 0.7, -1)
    assert tok.dtype == torch.int64 and lp.dtype == torch.float32 and tok.shape == lp.shape == (4,)
    assert torch.equal(tok[greedy], ref.argmax(-1)[greedy]), (tok, ref.argmax(-1))
    diff = float((ref.gather(1, tok[:, None]).squeeze(1) - lp).abs().max())
    assert diff < 1e-5, diff
    assert int(seed) == before + 1, "the seed moves on by one a call"
    # the same seed draws the same tokens; the next one others
    again, _ = fs.sample(logits, greedy, 0.7, torch.tensor([before]), chunk=1024)
    other, _ = fs.sample(logits, greedy, 0.7, torch.tensor([before + 7]), chunk=1024)
    assert torch.equal(again, tok) and not torch.equal(other[~greedy], tok[~greedy])
    # a token past the first chunk can win (the chunks' indices are offset)
    assert int(tok.max()) >= 1024 or int(other.max()) >= 1024
    return {"logprob_absdiff_max": diff}


def draws_follow_the_tempered_softmax() -> dict:
    """240 draws of one 3-token distribution at temperature 2: a chi-square test against
    softmax(logits / 2) that the untempered distribution would fail (chi-square ~20)."""
    rows = 240
    p = torch.tensor([0.6, 0.3, 0.1])
    logits = p.log().to(torch.bfloat16).expand(rows, 3).contiguous()
    tok, lp = fs.sample(logits, torch.zeros(rows, dtype=torch.bool), 2.0, fs.new_seed("cpu"), chunk=64)
    want = torch.softmax(logits[0].float() / 2.0, -1)
    counts = torch.bincount(tok, minlength=3).float()
    chi2 = float(((counts - rows * want) ** 2 / (rows * want)).sum())
    assert chi2 < 13.8, (chi2, counts.tolist())  # p = 0.001 at 2 degrees of freedom
    assert torch.allclose(lp, want.log()[tok], atol=1e-5)
    return {"chi2": round(chi2, 2), "counts": counts.tolist()}


def in_the_slot_decoder(model_dir: str) -> dict:
    """The slot decoder's step with the kernels in place of its torch ops: greedy requests decode
    the same tokens, and sampled tokens carry the log-probs of a forward of the model."""
    from transformers import AutoModelForCausalLM

    from streamrl.engines.slot_decoder import SlotDecoder
    from streamrl.training.logprobs import token_logprobs

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    prompt = [1, 5, 9, 13, 2]

    def run(fused: bool, greedy: bool) -> tuple[list[int], list[float]]:
        dec = SlotDecoder(model, slots=2, context=24, max_new_tokens=6, temperature=0.8, stop_ids=(), graphs=False)
        if fused:  # (a CPU decoder never picks the kernels itself: they are for a GPU)
            dec.fused, dec._fused_sample, dec._seed = True, fs.sample, fs.new_seed("cpu")
        dec.prefill([(0, prompt, 6, greedy)])
        for _ in range(5):
            dec.step(1)
        return dec.release([0])[0]

    greedy_torch, greedy_fused = run(False, True)[0], run(True, True)[0]
    assert greedy_torch == greedy_fused, (greedy_torch, greedy_fused)
    tokens, logprobs = run(True, False)
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        forward = token_logprobs(model, ids, torch.ones_like(ids), 0.8)[0, len(prompt) - 1:]
    diff = float((forward - torch.tensor(logprobs)).abs().max())
    assert diff < 1e-4, diff
    return {"decoder_logprob_absdiff_max": diff}


if __name__ == "__main__":
    found = {**chunked_logprobs_and_argmax(), **draws_follow_the_tempered_softmax(), **in_the_slot_decoder(sys.argv[1])}
    print(json.dumps(found))
    sys.exit(0 if all(math.isfinite(v) for v in found.values() if isinstance(v, float)) else 1)
