"""Safe files: atomic writes, caches set aside when unreadable, run-directory locks, writable checks.

Every file mechdiff writes goes to a unique temporary name in the same directory first, is
flushed to disk, then renamed over the target, so an interrupted run (Ctrl-C, SIGTERM, a crash)
never leaves a half-written result behind: the target is either the old file or the new one.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Iterator

log = logging.getLogger("mechdiff")

LOCK_NAME = ".mechdiff.lock"


class OutputError(OSError):
    """An output directory that cannot be written; the message names it and the fix."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the process is so that every ``finally`` runs (locks, temporary files)."""


_SIGNALLED: list[int] = []  # the signal numbers received; a handler's exception can be swallowed (in __del__)


def terminate(signum: int, frame: object) -> None:
    """SIGTERM handler: remember the signal, then raise `Terminated` where the process is."""
    _SIGNALLED.append(signum)
    raise Terminated(f"signal {signum}")


def check_terminated() -> None:
    """Raise `Terminated` if a signal arrived whose exception was swallowed (Python ignores exceptions
    raised inside ``__del__``); called at stage boundaries, so such a run still stops at the next one."""
    if _SIGNALLED:
        raise Terminated(f"signal {_SIGNALLED[-1]}")


def clear_terminated() -> None:
    _SIGNALLED.clear()


class RunLockedError(RuntimeError):
    """Another live process holds the run directory; the message names its PID and the lock file."""


@contextmanager
def atomic_open(path: str | Path, mode: str = "w") -> Iterator[IO]:
    """Open a unique temporary file beside ``path``; on success it is fsynced and renamed over ``path``,
    on any exception (KeyboardInterrupt included) it is removed and ``path`` is left as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, mode) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` atomically."""
    with atomic_open(path, "w") as handle:
        handle.write(text)
    return Path(path)


def write_json(path: str | Path, data: Any) -> Path:
    """Write ``data`` as indented JSON atomically."""
    return write_text(path, json.dumps(data, indent=2, default=str) + "\n")


def save_figure(fig: Any, path: str | Path, dpi: int = 150) -> Path:
    """Save a matplotlib figure as PNG atomically and close it."""
    import matplotlib.pyplot as plt

    try:
        with atomic_open(path, "wb") as handle:
            fig.savefig(handle, format="png", dpi=dpi, bbox_inches="tight")
    finally:
        plt.close(fig)
    return Path(path)


def set_aside(path: str | Path, what: str, reason: object) -> Path:
    """Move an unreadable cache file out of the way under a timestamped name and warn.

    Only for caches mechdiff itself wrote and can recompute (stage records, the activation store);
    never for anything a user wrote (task files, circuits, results). Returns the new name.
    """
    path = Path(path)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = path.with_name(f"{path.name}.unreadable-{stamp}")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.unreadable-{stamp}-{n}")
    os.replace(path, target)
    log.warning(
        "%s %s is unreadable (%s); moved it aside to %s and will recompute it", what, path, _short(reason), target.name
    )
    return target


def read_record(path: str | Path, what: str, required: tuple[str, ...] = ()) -> dict | None:
    """A JSON cache record mechdiff wrote: ``None`` when absent; when unreadable (truncated, garbled,
    not an object, or missing one of ``required``) it is set aside (`set_aside`) and ``None``
    returned, so the caller recomputes it."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            raise ValueError(f"a JSON {type(data).__name__}, not an object")
        missing = [k for k in required if k not in data]
        if missing:
            raise ValueError(f"no field {', '.join(missing)}")
    except (OSError, UnicodeDecodeError, ValueError) as err:  # JSONDecodeError is a ValueError
        set_aside(path, what, err)
        return None
    return data


def _short(reason: object, limit: int = 160) -> str:
    text = f"{type(reason).__name__}: {reason}" if isinstance(reason, BaseException) else str(reason)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_writable(directory: str | Path, what: str = "output directory") -> Path:
    """Raise `OutputError` naming ``directory`` unless a file can be created in it (it is made
    if missing). Tries a real write, so it holds for root too (who ignores permission bits)."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".mechdiff-write-check.", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        reason = err.strerror or str(err)
        raise OutputError(
            f"{directory}: the {what} cannot be written ({reason}) — "
            "choose another directory (--out, or [output] dir / store in the task file) "
            "or make it writable"
        ) from None
    return directory


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by someone else
        return True
    return True


def _holder(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


#: Seconds between two looks at the stage cache while one process waits on a record another process writes (a
#: look reads one record's key; a run waits on a few records, so a short poll costs nothing and wastes no core).
WAIT_POLL = 1.0


@contextmanager
def run_lock(directory: str | Path) -> Iterator[Path]:
    """Hold ``<directory>/.mechdiff.lock`` (with this process's PID) for the duration of a run.

    A second run on the same directory while the holder lives is refused with
    `RunLockedError` naming the holder's PID. The lock is an ``flock`` on the file, so a
    holder that died (even by SIGKILL) leaves a stale file that the next run takes over.
    """
    directory = check_writable(directory, "run directory")
    path = directory / LOCK_NAME
    while True:
        handle = open(path, "a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = _holder(path)
            handle.close()
            raise RunLockedError(
                f"{path}: another mechdiff run (PID {pid if pid is not None else 'unknown'}) is using {directory} — "
                "wait for it to finish, stop it, or run with another --out"
            ) from None
        try:  # the file may have been removed by the previous holder between open and flock
            same = os.fstat(handle.fileno()).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        handle.close()
    stale = _holder(path)
    if stale is not None and stale != os.getpid():
        log.warning(
            "%s: taking over the lock of PID %d, which is %s",
            path,
            stale,
            "no longer running" if not _pid_alive(stale) else "not holding it",
        )
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)
        handle.close()
