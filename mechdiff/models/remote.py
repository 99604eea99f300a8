"""Remote execution on NDIF through nnsight: the same code path as a local run, requests grouped.

A model loaded with ``remote=True`` (`mechdiff.models.loading.load_remote`) keeps only its config
and tokenizer here; every trace of the one driver (`mechdiff.patching.core.run`) is shipped to NDIF
(``model.trace(..., remote=True)``), and a `LoadedModel.session` groups every trace inside it into one
request (``model.session(remote=True)``): its body runs on the server,
values flow between its traces there, and only what the body keeps comes back. Path
patching runs a whole step (every chunk of senders, the frozen and the receiver runs) in one
session; `mechdiff.patching.path_pairs.prepare` its clean and counterfactual runs in one.

``remote="local"`` is nnsight's local simulation of that path (``LocalSimulationBackend``):
each request is serialised exactly as for NDIF, deserialised with mechdiff's own modules
hidden (as on a server that does not have it installed) and run in this process. The tests
use it in place of NDIF.

mechdiff is not installed on NDIF, so it is registered for serialisation by value
(``nnsight.register``): the functions a request calls travel as source.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Optional

from .registry import ModelSpec
from .resolve import resolve_spec

log = logging.getLogger(__name__)

API_KEY_ENV = "NDIF_API_KEY"


class RemoteSetupError(ValueError):
    """``--remote`` cannot run: no API key, or a checkpoint NDIF cannot name."""


def api_key() -> Optional[str]:
    """The NDIF API key: ``$NDIF_API_KEY``, else nnsight's own config (``CONFIG.set_default_api_key``)."""
    key = os.environ.get(API_KEY_ENV)
    if key:
        return key
    try:
        from nnsight import CONFIG

        return CONFIG.API.APIKEY or None
    except Exception:  # noqa: BLE001 - no nnsight config is the same as no key
        return None


def check_remote(remote: bool | str, specs: Optional[list[ModelSpec]] = None) -> None:
    """Refuse ``--remote`` before anything loads: the API key must be set and every model a hub id.

    ``remote="local"`` (the local stand-in) needs neither.
    """
    if remote is not True:
        return
    if not api_key():
        raise RemoteSetupError(
            f"--remote runs on NDIF and needs an API key: set {API_KEY_ENV}=<your key> (get one at "
            'https://login.ndif.us), or save it once with `python -c "from nnsight import CONFIG; '
            "CONFIG.set_default_api_key('<key>')\"`. Nothing was loaded."
        )
    for spec in specs or []:
        hub_repo(spec)


def hub_repo(spec: ModelSpec) -> tuple[str, Optional[str], Optional[str]]:
    """``(repo id, revision, peft adapter repo or None)`` naming ``spec`` on NDIF."""
    if spec.kind == "hub":
        return spec.source, spec.revision, None
    if spec.kind == "lora" and not spec.source.startswith("package:") and not os.path.exists(spec.source):
        base = resolve_spec(spec.base)
        if base.kind == "hub":
            return base.source, base.revision, spec.source
    raise RemoteSetupError(
        f"--remote: {spec.name} is a {spec.kind} checkpoint ({spec.source}); NDIF runs only models it hosts, "
        "named by their hub id (a registry name of kind hub, hub:org/name, or a hub LoRA adapter over a hub "
        "base). Run it locally instead (--device cuda, --device-map auto)."
    )


class ModelView:
    """What a remote request carries in place of a `LoadedModel`: the nnsight wrapper, the shape
    and the architecture, no weights. On the server its traces run in place (``remote`` is False).

    (A LoadedModel itself cannot travel: mechdiff's classes are pickled by value and
    ``functools.cached_property`` holds a lock on Python 3.11.)
    """

    remote = False

    def __init__(self, name: str, nn: Any, shape: Any, arch: Any) -> None:
        self.name, self.nn, self.shape, self.arch = name, nn, shape, arch
        self.model = nn._module
        self.tokenizer = getattr(nn, "tokenizer", None)

    @property
    def device(self) -> Any:
        return next(self.model.parameters()).device

    def trace(self, **kwargs: Any) -> Any:
        return self.nn.trace(**kwargs)

    def session(self) -> Any:
        return contextlib.nullcontext()


def register_mechdiff() -> None:
    """Ship mechdiff's code by value with every request (NDIF does not have it installed)."""
    import nnsight

    nnsight.register("mechdiff")


def in_trace() -> bool:
    """True while an nnsight trace or session body is running (its nested traces stay in it)."""
    from nnsight.tracing.tracer import _local

    return getattr(_local, "depth", 0) > 0


def session(model: Any) -> Any:
    """One remote request of ``model`` (a `LoadedModel`) for every trace
    inside the ``with`` block; a no-op for a local model.

    The returned object must be entered directly by a ``with`` statement (nnsight captures the
    block's source from that frame). The body must `keep` what it returns.
    """
    if not model.remote or in_trace():
        return contextlib.nullcontext()
    register_mechdiff()
    return model.nn.session(remote=model.remote)


def keep(value: Any) -> Any:
    """Return ``value`` from a remote session body (``nnsight.save``); a no-op outside one.

    Keep plain tensors and Python containers of them: objects of mechdiff's classes come back
    as copies of by-value classes, which do not compare equal to the local ones.
    """
    if in_trace():
        import nnsight

        nnsight.save(value)
    return value
