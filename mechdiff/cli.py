"""The ``mechdiff`` command. Each subcommand lives in ``mechdiff/commands/<name>.py``
and registers itself with ``register(subparsers)``."""

from __future__ import annotations

import argparse
import importlib
import logging
import pkgutil
import signal
import sys
import threading
from typing import Optional, Sequence

from . import commands
from .common.io import Terminated  # raised by the SIGTERM handler (mechdiff.common.io.terminate)

#: Library warnings a mechdiff user cannot act on (they name calls inside the libraries), each silenced by its
#: message, category and warning module only: (message regex, category, module regex).
QUIET_WARNINGS = (
    # peft asks transformers' deprecated alias when it wraps a model for a LoRA (transformers 5)
    (r"`is_gradient_checkpointing` is deprecated", FutureWarning, r"transformers\.modeling_utils"),
)


def quiet_library_warnings() -> None:
    """Filter `QUIET_WARNINGS` (every other warning still reaches the terminal)."""
    import warnings

    for message, category, module in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)


def quiet_library_bars() -> None:
    """Where mechdiff draws no bar (stderr not a terminal: `interactive`), neither
    do transformers (weight loading) and huggingface_hub (downloads), so a study's log holds no bar."""
    from .common.progress import interactive

    if interactive():
        return
    from huggingface_hub.utils import disable_progress_bars
    from transformers.utils import logging as transformers_logging

    disable_progress_bars()
    transformers_logging.disable_progress_bar()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mechdiff", description="Compare the mechanisms inside checkpoints of one language model."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log what each stage does and skips")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        if not info.name.startswith("_"):
            importlib.import_module(f"{commands.__name__}.{info.name}").register(sub)
    return parser


def _quiet_terminated(hook: object):
    """An unraisable hook that drops a `Terminated` raised inside ``__del__`` (the run stops at the next
    stage boundary instead, `check_terminated`) and passes anything else on."""

    def unraisable(info: object) -> None:
        if not isinstance(getattr(info, "exc_value", None), Terminated):
            hook(info)  # type: ignore[operator]

    return unraisable


def _on_sigterm(handler: object) -> object:
    """Install a SIGTERM handler (main thread only; elsewhere nothing changes); returns the previous one."""
    if handler is None or threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, handler)


def main(argv: Optional[Sequence[str]] = None) -> int:
    from .common.io import RunLockedError, check_terminated, clear_terminated, terminate

    args = build_parser().parse_args(argv)
    quiet_library_warnings()
    quiet_library_bars()
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    clear_terminated()
    previous, hook = _on_sigterm(terminate), sys.unraisablehook
    sys.unraisablehook = _quiet_terminated(hook)
    try:
        code = int(args.func(args) or 0)
        check_terminated()  # a signal swallowed after the last stage boundary still ends as a termination
        return code
    except (ValueError, KeyError, OSError, RunLockedError) as err:
        if args.verbose:
            raise
        print(f"mechdiff {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as err:
        print(
            f"mechdiff {args.command}: interrupted — every finished stage is kept; "
            "run the same command again to resume",
            file=sys.stderr,
        )
        return 143 if isinstance(err, Terminated) else 130
    finally:
        _on_sigterm(previous)
        sys.unraisablehook = hook


if __name__ == "__main__":
    sys.exit(main())
