"""Progress bars that give way to plain lines where no one watches: every bar of mechdiff is `progress_bar`.

On a terminal (stderr is a TTY) or in a notebook, `progress_bar` is the ``tqdm.auto`` bar as always. Where
stderr is a file or a pipe (a study's log, CI) it draws nothing, so the log holds no carriage returns or cursor
escapes; the stage cache (`mechdiff.runs.stages.StageCache`) writes one plain line per stage instead,
through `note`.
"""

from __future__ import annotations

import sys
from typing import Any, Iterable, Optional, TextIO

from tqdm.auto import tqdm


def interactive(stream: Optional[TextIO] = None) -> bool:
    """Whether bars are drawn on ``stream`` (default ``sys.stderr``): it is a terminal, or tqdm draws notebook
    widgets (which write no text to it)."""
    if any(c.__module__ == "tqdm.notebook" for c in tqdm.__mro__):
        return True
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no stream, or a closed one
        return False


def progress_bar(iterable: Optional[Iterable] = None, **kwargs: Any) -> tqdm:
    """``tqdm(iterable, **kwargs)`` drawn only where `interactive` (on ``kwargs["file"]``, default stderr);
    elsewhere disabled (``disable=True``, as ``--no-progress`` always was): it iterates the same, writes nothing."""
    kwargs["disable"] = bool(kwargs.get("disable", False)) or not interactive(kwargs.get("file"))
    return tqdm(iterable, **kwargs)


def note(line: str) -> bool:
    """Write ``line`` to stderr where no bar is drawn (not `interactive`), in place of the bars; returns
    whether it was written (on a terminal it is not: the bars show the progress)."""
    if interactive():
        return False
    print(line, file=sys.stderr, flush=True)
    return True
