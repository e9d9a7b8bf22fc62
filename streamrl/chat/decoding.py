"""Token ids as text, the way a sample's response and a streamed completion both need it."""

from __future__ import annotations

import functools
import re


def plain_text(tokenizer, tokens: list[int]) -> str:
    """``tokens`` as text, special tokens left out.

    The fast tokenizer's own decode where transformers' would add nothing to it (no clean-up of
    spaces): transformers checks every id's type first, which was half the time of a sample's
    hand-back at 256 tokens, and a streamed completion decodes twice per event."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return tokenizer.decode(tokens, skip_special_tokens=True)
    return backend.decode(tokens, skip_special_tokens=True)


def token_bytes(tokenizer, tokens: list[int]) -> list[bytes]:
    """Each token's own bytes (OpenAI's ``logprobs.content[].bytes``), which a client joins to
    rebuild characters split over tokens. Decoded one at a time, a token holding part of a UTF-8
    character is U+FFFD, three bytes that are none of its own; so a byte-level BPE's token
    (GPT-2's, Qwen's, Llama 3's, SmolLM2's) is read through its byte alphabet, a SentencePiece
    byte fallback's ``<0xNN>`` as that byte (and ``▁`` as a space), and any other as its text."""
    names = tokenizer.convert_ids_to_tokens(list(tokens))
    decoder = repr(getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None))
    # (an added token is written as its text, not in the byte alphabet: "<|im_end|>", "é")
    added = {i: text for text, i in tokenizer.get_added_vocab().items()}
    out = []
    for token, name in zip(tokens, names):
        if token in added:
            out.append(added[token].encode("utf-8"))
        elif isinstance(name, str) and "ByteLevel" in decoder and all(ch in _byte_alphabet() for ch in name):
            out.append(bytes(_byte_alphabet()[ch] for ch in name))
        elif isinstance(name, str) and "ByteFallback" in decoder and _BYTE_TOKEN.fullmatch(name):
            out.append(bytes([int(name[3:5], 16)]))
        elif isinstance(name, str) and "ByteFallback" in decoder:
            out.append(name.replace("\u2581", " ").encode("utf-8"))
        else:
            out.append(tokenizer.decode([token]).encode("utf-8"))
    return out


_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


@functools.cache
def _byte_alphabet() -> dict[str, int]:
    # (byte-level BPE writes its vocabulary in printable stand-ins for the 256 bytes: GPT-2's map)
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {ch: b for b, ch in bytes_to_unicode().items()}
