"""A served token's ``bytes`` are its own (OpenAI's ``logprobs.content[].bytes``): joined, a reply's
tokens give back its characters, also one split over tokens (an emoji, an accented letter)."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from streamrl.chat.decoding import token_bytes

TEXT = "hé 😀 ok"


def byte_level() -> PreTrainedTokenizerFast:
    """A byte-level BPE without merges (GPT-2's, Qwen's, SmolLM2's kind): one token per byte."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(sorted(alphabet))}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def byte_fallback() -> PreTrainedTokenizerFast:
    """A SentencePiece-style BPE (Llama 2's, Mistral's kind): words it knows, other bytes as <0xNN>."""
    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    vocab.update({"\u2581ok": 256, "h": 257, "\u2581": 258})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_each_tokens_bytes_are_its_own_and_join_to_the_text():
    added = byte_level()
    added.add_tokens(["<|end|>", "é!"])  # (an added token is its text, whatever its characters)
    ids = added("hé!<|end|>", add_special_tokens=False).input_ids
    assert b"".join(token_bytes(added, ids)) == "hé!<|end|>".encode("utf-8")
    for tok in (byte_level(), byte_fallback()):
        ids = tok(TEXT, add_special_tokens=False).input_ids
        pieces = token_bytes(tok, ids)
        assert len(pieces) == len(ids) and b"".join(pieces).decode("utf-8").strip() == TEXT
        # (decoded one at a time, a token of part of a character is U+FFFD: not its bytes)
        assert any("\ufffd" in tok.decode([i]) for i in ids)


def test_a_chat_replys_logprobs_carry_each_tokens_own_bytes():
    from types import SimpleNamespace

    from streamrl.serve.response_bodies import Format

    tok = byte_level()
    ids = tok(TEXT, add_special_tokens=False).input_ids
    fmt = Format(SimpleNamespace(model_name="policy", tokenizer=tok), SimpleNamespace(logprobs=True), "c", True, [])
    content = fmt._token_logprobs(ids, [-0.5] * len(ids))["content"]
    assert bytes(b for entry in content for b in entry["bytes"]).decode("utf-8") == TEXT
