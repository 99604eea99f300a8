"""Component names: heads, MLPs and the embedding, and key/value groups (mechdiff.common.components)."""

from __future__ import annotations

import pytest

from mechdiff.common.components import Head, kv_group, parse


def test_component_names():
    assert parse("L14H7") == Head(14, 7) and Head(14, 7).name == "L14H7"
    assert parse([3, 2]) == Head(3, 2)
    assert str(parse("MLP17")) == "MLP17" and parse("EMB") == "EMB"
    assert kv_group(8, 9, 3) == 2 and Head(0, 5).kv_group(9, 3) == 1
    with pytest.raises(ValueError, match="L<layer>H<head>"):
        parse("head 3")
