"""A string's tokens as a model's tokenizer makes them, offline: what every record of a task holds
(``tokenizer(text)["input_ids"]``, special tokens included), with each token's text and character span
(``mechdiff tokens TEXT --model M``; from Python `tokens`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from .catalog import availability
from .loading import load_tokenizer
from .registry import ModelSpec
from .resolve import resolve_spec


@dataclass(frozen=True)
class Token:
    """One token of a text: its index, id, the text it decodes to and the characters ``[start, end)`` of the text it
    covers (``None`` for a token the tokenizer adds, such as a beginning-of-sequence token, or where the tokenizer
    gives no offsets)."""

    index: int
    id: int
    piece: str
    start: Optional[int] = None
    end: Optional[int] = None


def tokens(
    text: str, model: str | ModelSpec = "", tokenizer: Any = None, cache_dir: Optional[str] = None
) -> list[Token]:
    """``text``'s tokens under ``model``'s tokenizer (a registry name, path, ``NAME@STEP`` or hub id in the local
    cache; no weights load, nothing is downloaded: `offline_tokenizer`) or a ``tokenizer`` already loaded: the
    ids a task's record of ``text`` holds, each with its text and span."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a string, got {type(text).__name__}")
    if tokenizer is None:
        tokenizer = offline_tokenizer(model, cache_dir)
    fast = getattr(tokenizer, "is_fast", False)
    enc = tokenizer(text, return_offsets_mapping=True) if fast else tokenizer(text)
    spans = enc["offset_mapping"] if fast else [None] * len(enc["input_ids"])
    out = []
    for i, (tid, span) in enumerate(zip(enc["input_ids"], spans)):
        start, end = (int(span[0]), int(span[1])) if span is not None and span[1] > span[0] else (None, None)
        out.append(Token(i, int(tid), tokenizer.decode([int(tid)]), start, end))
    return out


def offline_tokenizer(model: str | ModelSpec, cache_dir: Optional[str] = None) -> Any:
    """``model``'s tokenizer from this machine's files only: refused, saying what it needs, where the checkpoint is
    not here (a hub id out of the Hugging Face cache would otherwise be downloaded, or retried for minutes
    offline)."""
    if not model:
        raise ValueError("give a model (a registry name, a path or a hub id; `mechdiff models` lists them)")
    spec = resolve_spec(model)
    found = availability(spec, cache_dir)
    if not found.ready:
        raise FileNotFoundError(
            f"{spec.name} is not on this machine ({found.needs}); its tokens are read offline: download it once "
            "(e.g. `huggingface-cli download REPO`), or give a local directory"
        )
    return load_tokenizer(spec, cache_dir)


def tokens_table(toks: list[Token]) -> str:
    """The tokens one a line: index, id, the piece (as a Python string, so spaces show) and its character span."""
    rows = [("#", "id", "piece", "chars")]
    rows += [(str(t.index), str(t.id), repr(t.piece), "" if t.start is None else f"{t.start}-{t.end}") for t in toks]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
