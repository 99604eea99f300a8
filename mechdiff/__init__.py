"""mechdiff: compare the mechanisms inside checkpoints of one language model.

``import mechdiff as md``: the public surface (docs/api/index.md), each name imported from `mechdiff.api` on first
use, so ``import mechdiff`` (and ``mechdiff --help``) loads neither torch nor pandas."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .version import __version__

#: Each public name -> the module of `mechdiff.api` that defines (or re-exports) it.
_EXPORTS = {
    "pair": "inputs",
    "load_model": "inputs",
    "task": "inputs",
    "import_rows": "inputs",
    "tokens": "inputs",
    "Study": "study",
    "Plan": "study",
    "Results": "results",
    "Estimate": "results",
    "Circuit": "results",
    "interval_figure": "results",
    "compare": "compare",
    "Comparison": "compare",
    "view": "view",
}
__all__ = [*_EXPORTS, "__version__"]

if TYPE_CHECKING:  # the names as type checkers and the docs see them (redundant aliases: re-exported)
    from .api.compare import (
        Comparison as Comparison,
    )
    from .api.compare import (
        compare as compare,
    )
    from .api.inputs import (
        import_rows as import_rows,
    )
    from .api.inputs import (
        load_model as load_model,
    )
    from .api.inputs import (
        pair as pair,
    )
    from .api.inputs import (
        task as task,
    )
    from .api.inputs import (
        tokens as tokens,
    )
    from .api.results import (
        Circuit as Circuit,
    )
    from .api.results import (
        Estimate as Estimate,
    )
    from .api.results import (
        Results as Results,
    )
    from .api.results import (
        interval_figure as interval_figure,
    )
    from .api.study import (
        Plan as Plan,
    )
    from .api.study import (
        Study as Study,
    )
    from .api.view import (
        view as view,
    )


def __getattr__(name: str) -> Any:
    """A public name, imported from its module of `mechdiff.api` on first use."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'mechdiff' has no attribute {name!r}; its public names: {', '.join(__all__)}")
    value = getattr(importlib.import_module(f"mechdiff.api.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
