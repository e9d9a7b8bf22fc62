"""Tiny Llama-style models with character-level tokenizers, made locally.

Nothing can be downloaded from a model hub here, so the tasks build their own model: a
``tokenizers`` WordLevel vocabulary of single characters wrapped in ``PreTrainedTokenizerFast``,
and a ``LlamaForCausalLM`` of a few hundred thousand parameters. Both are written with
``save_pretrained`` and read back with ``from_pretrained`` like any hub model.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIALS = ["<pad>", "<bos>", "<eos>"]

#: One token per chat role, and the end of a turn: what the tiny models' chat template writes.
CHAT_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]

#: The tiny models' chat template (Jinja, as ``tokenizer.apply_chat_template`` runs it): each
#: message as ``<|role|>content<|end|>`` after ``<bos>`` (as the engine starts a plain prompt), then
#: ``<|assistant|>`` when a reply is asked for.
CHAT_TEMPLATE = ("{{- bos_token -}}{%- for m in messages -%}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{%- endfor -%}"
                 "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}")


def char_tokenizer(alphabet: str) -> PreTrainedTokenizerFast:
    """A tokenizer with one token per character of ``alphabet`` plus ``<pad> <bos> <eos>`` and
    the chat tokens, with a chat template (so the chat path runs end to end on a tiny model)."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHAT_TOKENS)}
    for ch in alphabet:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()  # join characters back without spaces
    out = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                  additional_special_tokens=CHAT_TOKENS)
    out.chat_template = CHAT_TEMPLATE
    return out


def tiny_llama(vocab_size: int, hidden: int = 128, layers: int = 2, heads: int = 4,
               max_positions: int = 64, seed: int = 0) -> LlamaForCausalLM:
    """A freshly initialised tiny Llama (``hidden=128, layers=2`` is about 330 K parameters)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
        max_position_embeddings=max_positions, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config)


def save(model, tokenizer, out: str | Path) -> Path:
    """Write model and tokenizer so ``from_pretrained(out)`` loads both."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
