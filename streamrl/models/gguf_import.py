"""``streamrl model import FILE.gguf --out DIR``: a GGUF file (llama.cpp's format, how many
pretrained models travel without a hub) as a transformers model folder a recipe points at.

transformers reads a GGUF file itself (``from_pretrained(folder, gguf_file=...)``, with the
``gguf`` package) and dequantizes its tensors to float weights. The model it returns is flagged
as quantized, and a folder saved from it would carry ``quantization_config`` and refuse to be
saved again after training; so the weights go into a model built from the same config without
that flag, saved as safetensors with the tokenizer (its chat template included) and the
generation config. The folder's ``README.md`` and ``streamrl-import.json`` say where it came
from: the file, its sha256 and its quantization (the weights are the quantized ones, dequantized,
not the original model's).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

from streamrl.errors import UserError
from streamrl.telemetry.text import message_line

#: What a GGUF file starts with.
MAGIC = b"GGUF"

#: The dtypes a folder can be saved in (``--dtype``): bfloat16 halves the folder, float32 keeps
#: every bit of the dequantized weights.
DTYPES = ("bfloat16", "float32")

#: Where a GGUF file names the tokens that end a turn besides its EOS (Llama 3's ``<|eot_id|>``
#: beside ``<|end_of_text|>``, Gemma's ``<end_of_turn>``). transformers' reader takes the EOS
#: alone into the generation config, and a response would run past its turn to the token limit.
TURN_END_KEYS = ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")

#: The file streamrl writes beside the weights to say where they came from.
PROVENANCE = "streamrl-import.json"


def sha256_of(path: Path) -> str:
    """The file's sha256, read in 1 MiB pieces."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_header(path: Path) -> dict:
    """``{"architecture", "quantization", "name", "turn_ends"}`` from the file's metadata
    (``turn_ends``: its end-of-turn and end-of-message token ids); one line when the file is
    missing, is not a GGUF file, or its header cannot be read."""
    if not path.is_file():
        raise UserError(f"{path}: no such file (expected a .gguf model file)")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as exc:  # (unreadable: its permissions, a folder's)
        raise UserError(f"{path}: cannot be read ({exc.strerror or type(exc).__name__})") from None
    if magic != MAGIC:
        raise UserError(f"{path}: not a GGUF file (it does not start with {MAGIC.decode()})")
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
        fields = reader.fields
        arch = fields["general.architecture"].contents()
        kind = fields["general.file_type"].contents() if "general.file_type" in fields else None
        name = fields["general.name"].contents() if "general.name" in fields else ""
        turn_ends = [fields[key].contents() for key in TURN_END_KEYS if key in fields]
    except Exception as exc:  # a truncated or damaged file: whatever the reader tripped on
        raise UserError(f"{path}: its GGUF header cannot be read ({type(exc).__name__}: "
                        f"{message_line(exc, 200)}); the file may be damaged or cut short") from None
    try:
        quantization = gguf.LlamaFileType(int(kind)).name.removeprefix("MOSTLY_") if kind is not None else "unknown"
    except (ValueError, TypeError):  # a number no llama.cpp release knows, or not a number at all
        quantization = f"file type {str(kind)[:40]}"
    turn_ends = [int(i) for i in turn_ends if isinstance(i, int) and not isinstance(i, bool) and i >= 0]
    return {"architecture": str(arch), "quantization": quantization, "name": str(name), "turn_ends": turn_ends}


def needs_packages() -> None:
    """One line naming what to install when the GGUF reader's packages are missing."""
    missing = [p for p in ("gguf", "accelerate") if importlib.util.find_spec(p) is None]
    if missing:
        raise UserError(f"reading GGUF files needs the {' and '.join(missing)} package"
                        f"{'s' if len(missing) > 1 else ''}: pip install 'streamrl[gguf]'")


def import_gguf(file: str | Path, out: str | Path, dtype: str = "bfloat16", source: str = "") -> Path:
    """Dequantize ``file`` into a transformers model folder at ``out`` (see the module
    docstring); returns it. ``source``: where the file came from, for the model card (default:
    the file's path). ``out`` must not exist yet: the folder is written beside it and renamed
    into place, so a failure leaves nothing half-written."""
    # transformers' GGUF reader draws a tqdm bar of its own that its logging settings do not
    # reach; tqdm reads this when it is first imported
    os.environ.setdefault("TQDM_DISABLE", "1")
    needs_packages()
    path, out = Path(file).resolve(), Path(out)
    if dtype not in DTYPES:
        raise UserError(f"--dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}")
    check_out(out)
    header = read_header(path)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from streamrl.models import pretrained

    hf_logging.disable_progress_bar()
    # read from a folder holding nothing but the file: transformers would take a tokenizer.json or
    # config.json lying beside it over the GGUF's own (another model's vocabulary, silently)
    with tempfile.TemporaryDirectory(prefix="streamrl-gguf-") as alone:
        (Path(alone) / path.name).symlink_to(path)
        try:
            tokenizer = AutoTokenizer.from_pretrained(alone, gguf_file=path.name)
            loaded = pretrained.causal_lm(alone, torch.float32, gguf_file=path.name)
            # the same model without the quantized flag: trainable, and saved again after training
            settings = loaded.config.to_dict()
            settings.pop("quantization_config", None)
            config = type(loaded.config).from_dict(settings)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            model.load_state_dict(loaded.state_dict(), strict=True)
        except Exception as exc:  # an architecture transformers cannot read, a tokenizer it cannot build
            raise UserError(f"{path}: transformers cannot read this {header['architecture']!r} GGUF model "
                            f"({type(exc).__name__}: {message_line(exc, 240)})") from None
    model.generation_config = loaded.generation_config
    eos = model.generation_config.eos_token_id
    ends = [eos] if isinstance(eos, int) else list(eos or [])
    more = [i for i in header["turn_ends"] if i not in ends and i < len(tokenizer)]
    if more:  # (every token that ends a response, as a Hub folder's generation_config lists them)
        model.generation_config.eos_token_id = ends + more
    model.to(getattr(torch, dtype))
    del loaded
    parameters = sum(p.numel() for p in model.parameters())
    digest = sha256_of(path)
    staging = out.parent / f".{out.name}.importing"
    try:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    except OSError as exc:
        raise UserError(f"--out: cannot write in {out.parent} ({exc.strerror or exc})") from None
    try:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        saved = json.loads((staging / "config.json").read_text())
        if "quantization_config" in saved:  # (would make the trained policy unsaveable at a run's end)
            raise RuntimeError("the saved config still says it is quantized")
        provenance = {"source": source or str(path), "file": path.name, "sha256": digest,
                      "quantization": header["quantization"], "architecture": header["architecture"],
                      "dtype": dtype, "parameters": parameters}
        (staging / PROVENANCE).write_text(json.dumps(provenance, indent=2) + "\n")
        (staging / "README.md").write_text(model_card(out.name, header, provenance))
        if out.exists():
            out.rmdir()  # (empty: checked above)
        staging.rename(out)
    except OSError as exc:  # a full disk, a folder not ours to write: one line, nothing left behind
        shutil.rmtree(staging, ignore_errors=True)
        raise UserError(f"--out: writing {out} failed ({type(exc).__name__}: {exc.strerror or exc})") from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def check_out(out: Path) -> None:
    """``out`` is where a folder can go: absent, or an empty folder."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out: {out} exists and is not an empty folder; remove it or choose another folder")


def model_card(name: str, header: dict, provenance: dict) -> str:
    """The folder's ``README.md``: what it is and where it came from."""
    called = f" ({header['name']})" if header["name"] else ""
    return (f"# {name}\n\n"
            f"Imported by `streamrl model import` from a GGUF file{called}.\n\n"
            f"- source: {provenance['source']}\n"
            f"- file: `{provenance['file']}`, sha256 `{provenance['sha256']}`\n"
            f"- quantization: {provenance['quantization']}, dequantized to {provenance['dtype']}: these are the "
            "quantized weights, not the original model's\n"
            f"- architecture: {provenance['architecture']}, {provenance['parameters']:,} parameters\n\n"
            "Load it with `AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained` "
            "(the tokenizer carries the model's chat template). The original model's license applies.\n")
