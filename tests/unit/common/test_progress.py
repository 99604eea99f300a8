"""Progress bars (mechdiff.common.progress): drawn on a terminal only, nothing written to a log or when disabled."""

from __future__ import annotations

import io

from mechdiff.common import progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_draws_on_a_terminal_only():
    term, log = _Terminal(), io.StringIO()
    assert list(progress.progress_bar(range(3), desc="x", file=term)) == [0, 1, 2] and "\r" in term.getvalue()
    assert list(progress.progress_bar(range(3), desc="x", file=log)) == [0, 1, 2] and log.getvalue() == ""
    bar = progress.progress_bar(total=2, file=log)
    bar.update(2)
    bar.close()
    assert log.getvalue() == ""
    quiet = _Terminal()
    list(progress.progress_bar(range(3), file=quiet, disable=True))
    assert quiet.getvalue() == ""
