"""GGUF checkpoints converted once into a plain transformers directory.

transformers parses a GGUF file once for the config, once for the tokenizer and once for the weights, and maps
every tensor name through gguf's tables: about 15 s for SmolLM2-135M on 2 cores, of which dequantizing is 2.5 s.
The first load of a GGUF file converts it (float32 safetensors, ``config.json``, the tokenizer's files) into
``<cache>/gguf/<stem>-<digest>``; every later load, in any process, reads that directory (about 1 s). The
cache is ``$MECHDIFF_CACHE`` or ``~/.cache/mechdiff``; ``MECHDIFF_CACHE=off`` reads the GGUF file every time.
A conversion costs 4 bytes per parameter of disk.

The directory is built beside its final name and renamed into place, so a killed conversion leaves nothing
that a load would read; its name holds the file's digest (name, size, first and last 8 MiB) and the
transformers and gguf versions, so a changed file or library converts anew. Dequantized weights are float32
(transformers' GGUF path), saved as they are: a load in any dtype casts from the same numbers as the GGUF path.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from importlib.metadata import version
from pathlib import Path
from typing import Optional

log = logging.getLogger(__name__)

CACHE_ENV = "MECHDIFF_CACHE"
MANIFEST = "mechdiff-gguf.json"


def cache_root() -> Optional[Path]:
    """Where conversions live, or None where ``MECHDIFF_CACHE=off``."""
    value = os.environ.get(CACHE_ENV, "")
    if value.lower() in ("off", "0", "no", "false"):
        return None
    return Path(value).expanduser() if value else Path.home() / ".cache" / "mechdiff"


def file_digest(path: Path, chunk: int = 8 << 20) -> str:
    """The file's name, size and first and last ``chunk`` bytes, with the transformers and gguf versions."""
    size = path.stat().st_size
    h = hashlib.sha256(f"{path.name}:{size}:{version('transformers')}:{version('gguf')}".encode())
    with open(path, "rb") as fh:
        h.update(fh.read(chunk))
        fh.seek(max(size - chunk, 0))
        h.update(fh.read(chunk))
    return h.hexdigest()[:16]


def converted(src: str | Path, gguf_file: str) -> tuple[str, dict]:
    """Where transformers should read the GGUF checkpoint ``src/gguf_file`` from: ``(directory, {})`` for its
    conversion (made here if missing), or ``(src, {"gguf_file": ...})`` where the cache is off."""
    root = cache_root()
    if root is None:
        return str(src), {"gguf_file": gguf_file}
    path = Path(src) / gguf_file
    final = root / "gguf" / f"{path.stem}-{file_digest(path)}"
    if not (final / MANIFEST).is_file():
        convert(path, final)
    return str(final), {}


def convert(path: Path, final: Path) -> Path:
    """Convert the GGUF file ``path`` into the transformers directory ``final`` (built beside it, then renamed;
    where another process renamed its own first, that one is kept)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s once into %s (later loads read it)", path, final)
    final.parent.mkdir(parents=True, exist_ok=True)
    building = final.with_name(f".{final.name}.{os.getpid()}.tmp")
    shutil.rmtree(building, ignore_errors=True)
    try:
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        model.hf_quantizer = None  # the weights are dequantized already; GGUF's quantizer does not serialise
        model.config.__dict__.pop("quantization_config", None)
        as_loaded = model.config.to_dict()
        model.save_pretrained(building)
        _keep_config(building / "config.json", as_loaded)
        AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(building)
        (building / MANIFEST).write_text(
            json.dumps(
                {
                    "gguf": str(path),
                    "size": path.stat().st_size,
                    "digest": file_digest(path),
                    "transformers": version("transformers"),
                    "gguf_version": version("gguf"),
                },
                indent=2,
            )
            + "\n"
        )
        try:
            os.replace(building, final)
        except OSError:  # another process finished first (a non-empty directory is not replaced)
            if not (final / MANIFEST).is_file():
                raise
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return final


def _keep_config(path: Path, as_loaded: dict) -> None:
    """Undo what ``save_pretrained`` adds to the config (``architectures``), so that the converted directory
    loads the config the GGUF path gives and `model_fingerprint` is unchanged."""
    saved = json.loads(path.read_text())
    for key in ("architectures",):
        saved[key] = as_loaded.get(key)
    path.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
