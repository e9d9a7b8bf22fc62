"""Models with a real architecture's shapes and random weights, for GPU benchmarks without a hub.

``streamrl model init --arch qwen2.5-0.5b --random --out DIR`` writes a transformers model folder
with Qwen2.5-0.5B's shapes (hidden 896, 24 layers, 14 query / 2 KV heads, vocabulary 151,936)
and freshly initialised weights, plus a tokenizer that encodes any printable ASCII text one
character per token and decodes every id of the vocabulary (ids beyond the characters decode
to ``<t123>``). The throughput of such a model is the real one; what it generates is noise.
With a hub, point ``model.path`` at the real checkpoint instead (``Qwen/Qwen2.5-0.5B-Instruct``).
"""

from __future__ import annotations

import string
from pathlib import Path

from streamrl.errors import UserError
from streamrl.telemetry.text import message_line

#: Config shapes of known checkpoints (values from their published config.json).
ARCHS = {
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                         max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                         tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                         max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                         tie_word_embeddings=True),
    "llama-3.2-1b": dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                         max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=True),
}


def any_id_tokenizer(vocab_size: int):
    """Character-level tokenizer over printable ASCII, padded with ``<tN>`` tokens to ``vocab_size``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from streamrl.tasks.tiny import SPECIALS

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in string.printable:
        if ch not in "\t\n\r\x0b\x0c":
            vocab.setdefault(ch, len(vocab))
    if vocab_size < len(vocab):
        raise UserError(f"vocab_size: at least {len(vocab)} (the characters), got {vocab_size}")
    for i in range(len(vocab), vocab_size):
        vocab[f"<t{i}>"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    # unk given explicitly: a qwen2 folder otherwise loads with an extra "<|endoftext|>" id
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                   unk_token="<pad>")


def random_model(arch: str, out: str, overrides: dict, dtype: str = "bfloat16", seed: int = 0,
                 device: str = "cpu") -> dict:
    """Write ``arch`` (a key of :data:`ARCHS`, its config changed by ``overrides``) with random
    weights in ``dtype`` and its tokenizer to ``out``; returns a small report. ``device``: where
    the weights are drawn (a GPU draws half a billion in seconds)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from streamrl.tasks.tiny import save

    if arch not in ARCHS:
        raise UserError(f"--arch: unknown {arch!r}; known: {', '.join(ARCHS)}")
    if Path(out).exists() and not Path(out).is_dir():  # (checked before the weights are drawn)
        raise UserError(f"--out: {out} is a file; expected a folder to write the model into")
    shape = {**ARCHS[arch], **overrides}
    model_type = shape.pop("model_type")
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("--init-device cuda: this machine has no CUDA GPU")
    try:
        config = AutoConfig.for_model(model_type, pad_token_id=0, bos_token_id=1, eos_token_id=2, **shape)
        torch.manual_seed(seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    except Exception as exc:  # noqa: BLE001 -- a --set transformers refuses (its config checks raise their own kinds)
        text = message_line(exc, 300)
        raise UserError(f"--arch {arch} with {overrides or 'its own shape'}: the model cannot be made "
                        f"({type(exc).__name__}: {text})") from None
    tokenizer = any_id_tokenizer(config.vocab_size)
    save(model, tokenizer, out)
    report = {"arch": arch, "overrides": overrides, "dtype": dtype,
              "parameters": sum(p.numel() for p in model.parameters())}
    print(report)
    return report
