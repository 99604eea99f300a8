"""`import mechdiff as md`: the public names, each from `mechdiff.api`, and an import that stays cheap for the CLI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import mechdiff as md

ROOT = Path(__file__).resolve().parents[3]


def test_import_mechdiff_loads_neither_torch_nor_pandas():
    """``mechdiff --help`` imports the package: the public names are imported on first use, not with it."""
    code = (
        "import sys, mechdiff; print(sorted(m for m in ('torch', 'pandas', 'mechdiff.api.study') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"


def test_every_public_name_is_the_api_modules_own():
    import mechdiff.api.compare as compare
    import mechdiff.api.inputs as inputs
    import mechdiff.api.results as results
    import mechdiff.api.study as study
    import mechdiff.api.view as view
    from mechdiff.circuits.circuit import Circuit
    from mechdiff.models.loading import load_model
    from mechdiff.models.tokenization import tokens

    names = [n for n in md.__all__ if n != "__version__"]
    assert len(names) == len(set(names)) == 14
    where = {n: next(m for m in (inputs, results, study, compare, view) if n in m.__all__) for n in names}
    assert all(getattr(md, n) is getattr(where[n], n) for n in names)
    assert md.load_model is load_model and md.tokens is tokens and md.Circuit is Circuit  # the commands' own
    assert set(names) <= set(dir(md))
    with pytest.raises(AttributeError, match="its public names: pair, load_model"):
        md.Pair  # noqa: B018


def test_tokens_are_mechdiff_tokens_offline(smollm2_tokenizer):
    """``md.tokens`` is ``mechdiff tokens``: each token's id and text as the tokenizer gives them, with its span."""
    toks = md.tokens(" The cat sat", model="smollm2-135m")
    ids = smollm2_tokenizer(" The cat sat")["input_ids"]
    assert [t.id for t in toks] == ids
    assert "".join(t.piece for t in toks) == " The cat sat"
    assert [(t.start, t.end) for t in toks][-1] == (8, 12)
