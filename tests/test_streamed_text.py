"""A served response's text as it streams: each event's new text decoded from the tokens since the
last one (behind a few decoded before them), which must add up to what decoding the whole
response gives -- for the tokenizers models ship: byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM),
SentencePiece-style BPE with byte fallback (Llama 2, Mistral) and the repo's character models."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from streamrl.serve.completion import MAX_CHARACTER_TOKENS, Choice, Completion, Params, decode
from tests.helpers import ROOT

TEXT = ["Hello world, the weather is 18 °C in Paris.", "Grüße aus Köln! Ça va? 東京は晴れ。", "x = [1, 2, 3]  # 🙂",
        "  leading and   inner spaces\nand lines\tand tabs", "don't , stop . here ?"] * 20


def byte_level() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXT, trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                      special_tokens=["<eos>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def sentencepiece_like() -> PreTrainedTokenizerFast:
    """Llama 2's layout: "▁" for spaces, byte tokens ``<0xNN>`` in the vocabulary for characters
    it lacks (here every character but ASCII letters and digits)."""
    normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.normalizer = normalizer
    trained.train_from_iterator([t.encode("ascii", "ignore").decode() for t in TEXT],
                                trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"]))
    vocab = trained.get_vocab()
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m)
              for m in __import__("json").loads(trained.to_str())["model"]["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizer
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")


def streamed(tok, tokens: list[int], chunks: list[int], stop: list[str] = ()) -> tuple[str, list[str], Choice]:
    """The choice's text after feeding ``tokens`` in ``chunks``, and each event's new text."""
    completion = SimpleNamespace(tokenizer=tok, keep=frozenset(), params=Params(max_tokens=len(tokens), stop=list(stop)))
    c, pieces, at = Choice(0, "r"), [], 0
    for size in chunks:
        c.tokens += tokens[at:at + size]
        at += size
        pieces.append(Completion._new_text(completion, c))
        if c.finish_reason:
            break
    return c.text, pieces, c


@pytest.mark.parametrize("make", [byte_level, sentencepiece_like,
                                  lambda: AutoTokenizer.from_pretrained(ROOT / "models" / "tiny-calculator")])
def test_the_streamed_pieces_add_up_to_the_whole_responses_text(make):
    tok = make()
    rng = random.Random(0)
    for text in TEXT[:5]:
        tokens = tok(text, add_special_tokens=False).input_ids
        for _ in range(20):
            chunks = [rng.choice([1, 1, 1, 2, 3]) for _ in tokens]
            got, pieces, _ = streamed(tok, tokens, chunks)
            assert got == "".join(pieces) == decode(tok, tokens, frozenset()), (text, chunks)
            assert not any("\ufffd" in p for p in pieces)  # a character split over byte tokens waits for its end


def test_a_stop_sequence_cuts_the_text_where_it_starts_and_nothing_of_it_is_sent():
    # the stop's first character came in an event of its own: held back until the stop was
    # whole, rather than sent and then missing from the text
    tok = byte_level()
    tokens = tok("the weather is 18 °C in Paris.", add_special_tokens=False).input_ids
    text, pieces, c = streamed(tok, tokens, [1] * len(tokens), stop=["°C"])
    assert text == "".join(pieces) == "the weather is 18 " and c.finish_reason == "stop"
    text, pieces, c = streamed(tok, tokens, [1] * len(tokens), stop=["°F"])  # a stop that never comes
    assert text == "the weather is 18 °C in Paris." and "".join(pieces) == text[:-1] and not c.finish_reason


def test_bytes_that_are_no_text_are_sent_as_they_are_after_a_few_tokens():
    # a model writing continuation bytes for ever: after MAX_CHARACTER_TOKENS the text goes out as
    # it decodes (replacement characters), not decoded again from its start at every step
    tok = sentencepiece_like()
    junk = [tok.convert_tokens_to_ids("<0x80>")] * (3 * MAX_CHARACTER_TOKENS)
    text, pieces, c = streamed(tok, junk, [1] * len(junk))
    assert text and set(text) == {"\ufffd"} and c.prefix_at > 0
    assert sum(1 for p in pieces if p) >= 2  # sent along the way, not held to the end


def test_a_streamed_reply_with_a_stop_that_never_comes_sends_its_whole_text_by_its_end(tiny_model):
    # the tail held back in case it began the stop goes out with the last chunk
    import openai

    from tests.helpers import slot_endpoint

    with slot_endpoint(tiny_model) as (_, url):
        client = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
        whole = client.completions.create(model="policy", prompt="12+34=", max_tokens=4, temperature=0)
        stream = client.completions.create(model="policy", prompt="12+34=", max_tokens=4, temperature=0,
                                           stop=["never here"], stream=True)
        assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == whole.choices[0].text != ""


def test_a_reply_that_ends_on_a_cut_character_keeps_the_characters_before_it():
    # "é" whole, then the first byte of "東" in the same event, then the reply ends (max_tokens):
    # the event waited for the cut character's end, which never came, and "é" was lost with it --
    # from the client's text and the text the reward scored
    import asyncio
    from concurrent.futures import Future

    tok = byte_level()
    # (GPT-2's bytes as characters: the printable ones as they are, the others from 256 on)
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    char = {**{b: chr(b) for b in printable}, **{b: chr(256 + k) for k, b in enumerate(others)}}
    byte = [tok.convert_tokens_to_ids(char[b]) for b in (0xC3, 0xA9, 0xE6)]
    head = tok("ok ", add_special_tokens=False).input_ids

    class Engine:  # (decodes the reply in two steps, then ends it at its length)
        stop_ids = ()

        def stream(self, rid, ids, max_new_tokens, on_tokens=None, greedy=False, prompt=None):
            future = Future()
            on_tokens(head + byte[:1], [-0.1] * (len(head) + 1), 1)
            on_tokens(byte[1:], [-0.1, -0.1], 1)
            future.set_result(SimpleNamespace(tokens=head + byte, stopped_early=False))
            return future

    async def reply():
        completion = Completion(Engine(), tok, "cmpl-x", [1], Params(max_tokens=len(head) + 3))
        completion.start()
        return [e async for e in completion.events()], completion

    events, completion = asyncio.run(reply())
    sent = "".join(e.text for e in events)
    assert sent == completion.choices[0].text == decode(tok, head + byte, frozenset()), (sent, completion.choices[0].text)
    assert "é" in sent and events[-1].finish_reason == "length"
    assert completion.samples()[0].response_text == sent
