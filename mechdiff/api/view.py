"""A results directory's page (`view`): ``report.html`` written from the directory's files, as ``mechdiff view``
writes it (the same function, `mechdiff.report.html.write_html`), returned as a `Report` that a notebook shows."""

from __future__ import annotations

import html
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from ..report.html import write_html
from .results import Results

__all__ = ["view", "Report"]

#: The height in pixels of the frame a notebook shows a report in.
FRAME_HEIGHT = 600


def view(results: Union[str, os.PathLike, Results], out: Optional[Union[str, os.PathLike]] = None) -> "Report":
    """Write (or refresh) the ``report.html`` of a results directory and return it, as ``mechdiff view`` does.

    The page is one self-contained file read from the directory's files alone (no model loads): a study's report
    (``mechdiff run`` or `Study.run` wrote the directory), a trajectory's, or any other results directory's tables
    and circuits.

    ``results``: a results directory, or its `Results`; ``out``: where the page goes (default: ``report.html`` in
    the directory), as ``mechdiff view --out``. Returns the page as a `Report`: its absolute path (``report.path``,
    ``os.fspath(report)``), which a notebook shows inline.
    """
    directory = results.dir if isinstance(results, Results) else Path(results)
    return Report(write_html(directory, None if out is None else Path(out)).absolute())


@dataclass(frozen=True)
class Report:
    """A written ``report.html``: a path-like object (``open(report)``, ``Path(report)``) that a notebook
    (Jupyter, VS Code) shows as a link to the page and the page in a frame. The frame loads the file by its path
    relative to the notebook's working directory, which the notebook server serves; a page outside that
    directory is shown as its path only (open it in a browser: it needs no server)."""

    path: Path

    def __fspath__(self) -> str:
        return os.fspath(self.path)

    def __str__(self) -> str:
        return str(self.path)

    def _repr_html_(self) -> str:
        """A link to the page and the page in a frame, or the path where the notebook's server cannot serve it."""
        relative = self.relative()
        if relative is None:
            return f"<code>{html.escape(str(self.path.resolve()))}</code> (open it in a browser)"
        href = html.escape(relative.as_posix(), quote=True)
        return (
            f'<a href="{href}" target="_blank">{html.escape(relative.as_posix())}</a><br>'
            f'<iframe src="{href}" width="100%" height="{FRAME_HEIGHT}" style="border:1px solid #ccc"></iframe>'
        )

    def relative(self) -> Optional[Path]:
        """The page's path from the working directory, where it lies under it; else None."""
        try:
            return self.path.resolve().relative_to(Path.cwd().resolve())
        except ValueError:
            return None
