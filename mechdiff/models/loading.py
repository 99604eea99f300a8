"""Load checkpoints (hub id, local directory, GGUF, LoRA merged with peft)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any, Optional

import torch

from .architectures import Architecture, ModelShape, architecture_for, shape_of
from .gguf_cache import converted
from .registry import ModelSpec
from .remote import ModelView, RemoteSetupError, check_remote, hub_repo, in_trace, register_mechdiff, session
from .resolve import resolve_source, resolve_spec

log = logging.getLogger(__name__)

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def offline() -> bool:
    """True when ``HF_HUB_OFFLINE`` is set (read at call time): hub ids resolve from the local cache only."""
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def load_config(spec: ModelSpec, cache_dir: Optional[str] = None) -> Any:
    """The transformers config of a spec, without loading weights (a LoRA's is its base's)."""
    from transformers import AutoConfig

    if spec.kind == "lora":
        return load_config(resolve_spec(spec.base), cache_dir)
    src, kwargs = _source(spec)
    if spec.kind == "hub":
        kwargs.update(revision=spec.revision, cache_dir=cache_dir, local_files_only=offline())
    return AutoConfig.from_pretrained(src, **kwargs)


def _source(spec: ModelSpec) -> tuple[str, dict]:
    """Where transformers reads a non-LoRA spec from, with the keyword that names a GGUF file (a GGUF file is
    read from its one-time conversion, `.gguf_cache`, unless that cache is off)."""
    src = resolve_source(spec.source)
    return converted(src, spec.gguf_file) if spec.kind == "gguf" else (src, {})


def load_tokenizer(spec: ModelSpec, cache_dir: Optional[str] = None) -> Any:
    """The tokenizer of a spec (a LoRA adapter's own if it ships one, else its base's)."""
    from transformers import AutoTokenizer

    src = resolve_source(spec.source)
    if spec.kind == "lora":
        if not (Path(src) / "tokenizer_config.json").is_file():
            return load_tokenizer(resolve_spec(spec.base), cache_dir)
        return AutoTokenizer.from_pretrained(src)
    src, kwargs = _source(spec)
    if spec.kind == "hub":
        kwargs.update(revision=spec.revision, cache_dir=cache_dir, local_files_only=offline())
    return AutoTokenizer.from_pretrained(src, **kwargs)


@dataclass
class LoadedModel:
    """A loaded checkpoint: weights, tokenizer, adapter, shape and provenance."""

    name: str
    spec: ModelSpec
    model: Any
    tokenizer: Any
    provenance: dict = field(default_factory=dict)
    remote: bool | str = False  # True: NDIF; "local": nnsight's local simulation of the remote path

    def __reduce__(self) -> tuple:
        """Pickled into a remote request (a session body names the model) as a `ModelView`:
        the nnsight wrapper (its modules by persistent id: the server's own model), shape and
        architecture; never the weights or the tokenizer."""
        return ModelView, (self.name, self.nn, self.shape, self.arch)

    @cached_property
    def shape(self) -> ModelShape:
        return shape_of(self.model, self.arch)

    @cached_property
    def arch(self) -> Architecture:
        return architecture_for(self.model)

    @cached_property
    def nn(self) -> Any:
        """The nnsight wrapper: the one intervention layer.

        Local models get a plain ``NNsight``; a remote model (``remote=True`` or ``"local"``) an
        nnsight ``TransformersModel``, the wrapper that can ship a trace or session to NDIF
        (``"local"``: serialised and run in this process, the stand-in used by the tests).
        """
        if self.remote:
            from nnsight import TransformersModel

            return TransformersModel(self.model, tokenizer=self.tokenizer, task="text-generation")
        from nnsight import NNsight

        return NNsight(self.model)

    @property
    def device(self) -> torch.device:
        """Where inputs go: the first parameter's device (the embedding's under ``device_map="auto"``).
        CPU for a model on NDIF (its weights are on the meta device here; the server places inputs)."""
        device = next(self.model.parameters()).device
        return torch.device("cpu") if device.type == "meta" else device

    def trace(self, **kwargs: Any) -> Any:
        """``nn.trace(**kwargs)``, shipped to NDIF (or its local stand-in) unless already inside a session."""
        if self.remote and not in_trace():
            if torch.is_grad_enabled():  # run() sets it to its grad argument
                raise RemoteSetupError(
                    "a backward pass through a remote forward needs the gradient computed on the server: run it "
                    "inside model.session() (the attribution screen does). DCM mask training does not run on "
                    "NDIF yet; run it locally (--device cuda, --device-map auto)."
                )
            register_mechdiff()
            return self.nn.trace(remote=self.remote, **kwargs)
        return self.nn.trace(**kwargs)

    def session(self) -> Any:
        """A context grouping every trace inside it into one remote request (see `.remote`);
        a no-op for a local model."""
        return session(self)

    @cached_property
    def fingerprint(self) -> str:
        """Digest of the config and the weights (a strided sample of every tensor, its shape and sum).
        A model on NDIF (weights not here) is fingerprinted by its hub id, revision and config."""
        if self.remote is True:
            return remote_fingerprint(self.model, self.spec)
        return model_fingerprint(self.model)


def model_fingerprint(model: Any) -> str:
    """sha256 of the config and a sample of every parameter; changes when any weight changes materially."""
    h = hashlib.sha256()
    cfg = model.config.to_dict()
    for volatile in ("transformers_version", "_name_or_path", "quantization_config", "dtype", "torch_dtype"):
        cfg.pop(volatile, None)
    h.update(json.dumps(cfg, sort_keys=True, default=str).encode())
    with torch.no_grad():
        for name, p in model.state_dict().items():
            flat = p.detach().reshape(-1).float().cpu()
            step = max(1, flat.numel() // 4096)
            h.update(name.encode())
            h.update(str(tuple(p.shape)).encode())
            h.update(flat[::step].numpy().tobytes())
            h.update(f"{flat.double().sum().item():.6e}".encode())
    dtype = weights_dtype(model, model.state_dict().values())
    # a checkpoint stored in bfloat16 samples alike loaded in float32 or bfloat16: the dtype tells them apart; a
    # float32 model's digest stays as it was, so committed float32 stage keys stay valid
    if dtype != "float32":
        h.update(dtype.encode())
    return h.hexdigest()[:16]


def weights_dtype(model: Any, tensors: Optional[Any] = None) -> str:
    """The dtype of ``model``'s floating-point parameters, or of ``tensors`` where given (``"float32"``,
    ``"bfloat16"``, ...; the first one's where they differ; ``"float32"`` where there is none)."""
    tensors = model.parameters() if tensors is None else tensors
    first = next((p.dtype for p in tensors if p.is_floating_point()), torch.float32)
    return str(first).removeprefix("torch.")


def dtype_inputs(model: Any) -> dict:
    """What a stage key keyed by model name adds for ``model``'s weights' dtype: nothing for float32 (committed
    float32 keys stay valid), ``{"dtype": ...}`` otherwise, so a bfloat16 run never reads a float32 record."""
    dtype = weights_dtype(model)
    return {} if dtype == "float32" else {"dtype": dtype}


def remote_fingerprint(model: Any, spec: ModelSpec) -> str:
    """A model held on NDIF: its hub id, revision and config (the weights never reach this machine)."""
    cfg = model.config.to_dict()
    for volatile in ("transformers_version", "_name_or_path", "quantization_config", "dtype", "torch_dtype"):
        cfg.pop(volatile, None)
    data = [spec.kind, spec.source, spec.revision, spec.base, cfg]
    return "remote-" + hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:9]


def resolve_device_map(device: Optional[str], device_map: Optional[str | dict]) -> Optional[str | dict]:
    """One placement from ``--device`` and ``--device-map``: the weights load straight onto it.

    ``device`` (``cpu``, ``cuda``, ``cuda:1``) puts the whole model on one device; ``device_map``
    (``auto``, ``balanced``, a dict) lets accelerate spread it over the GPUs of the machine.
    """
    if device in (None, "", "none"):
        return device_map
    if device_map not in (None, "", device):
        raise ValueError(
            f"--device {device} and --device-map {device_map} disagree; give one "
            "(--device for one device, --device-map auto to shard over the GPUs)"
        )
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(
            f"--device {device}: CUDA is not available on this machine (torch "
            f"{torch.__version__}); use --device cpu, or run with --remote on NDIF"
        )
    return "cuda:0" if device == "cuda" else device


def load_model(
    model: str | ModelSpec,
    *,
    dtype: str = "float32",
    device_map: Optional[str | dict] = None,
    device: Optional[str] = None,
    remote: bool | str = False,
    base: Optional[str] = None,
    revision: Optional[str] = None,
    cache_dir: Optional[str] = None,
    attn_implementation: str = "eager",
    tokenizer: Any = None,
) -> LoadedModel:
    """Load any checkpoint mechdiff knows: registry name, hub id, local dir, GGUF file, LoRA adapter.

    LoRA adapters are merged into their base with peft (``merge_and_unload``) and the
    merge is recorded in ``provenance``. ``attn_implementation="eager"`` keeps attention
    patterns readable. ``device`` / ``device_map``: see `resolve_device_map`.
    ``remote=True`` runs every trace on NDIF (nnsight; the API key from ``NDIF_API_KEY``):
    only the config and tokenizer are read here, the weights stay on the server (see
    `mechdiff.models.remote`). ``remote="local"`` loads the weights here and runs the same
    serialised requests in this process (nnsight's local simulation of the remote path). ``tokenizer``: the
    spec's tokenizer, already loaded (a command that built its prompts before the weights), else loaded here.
    """
    spec = resolve_spec(model, base=base, revision=revision)
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    if remote is True:
        return load_remote(spec, dtype=dtype, cache_dir=cache_dir, tokenizer=tokenizer)
    device_map = resolve_device_map(device, device_map)
    hf_model, provenance = _load_weights(spec, DTYPES[dtype], device_map, cache_dir, attn_implementation)
    hf_model.eval()
    hf_model.requires_grad_(False)
    contiguous_unembedding(hf_model)
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(spec, cache_dir)
    provenance.update(dtype=dtype, device_map=device_map)
    if remote:
        provenance.update(remote=remote)
    loaded = LoadedModel(spec.name, spec, hf_model, tokenizer, provenance, remote=remote)
    _ = loaded.arch  # fail early for a model no adapter pattern fits (resolved from its modules)
    log.info("loaded %s (%s)", spec.name, provenance)
    return loaded


def load_remote(
    spec: ModelSpec, dtype: str = "float32", cache_dir: Optional[str] = None, tokenizer: Any = None
) -> LoadedModel:
    """A model on NDIF: config and tokenizer here, the architecture on the meta device, no weights."""
    from nnsight import TransformersModel

    check_remote(True, [spec])
    repo, revision, adapter = hub_repo(spec)
    register_mechdiff()
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(spec, cache_dir)
    kwargs: dict[str, Any] = {"revision": revision, "task": "text-generation", "tokenizer": tokenizer}
    if adapter:
        kwargs["peft"] = adapter
    nn = TransformersModel(repo, **kwargs)  # meta build: config only
    architecture_for(nn._module)  # resolved from the meta-built modules; fails early
    provenance = {
        "kind": "remote",
        "repo": repo,
        "revision": revision,
        "adapter": adapter,
        "dtype": f"as deployed on NDIF (asked {dtype})",
        "remote": True,
    }
    loaded = LoadedModel(spec.name, spec, nn._module, tokenizer, provenance, remote=True)
    loaded.__dict__["nn"] = nn
    log.info("remote model %s: %s (weights on NDIF)", spec.name, repo)
    return loaded


def contiguous_unembedding(hf_model: torch.nn.Module) -> None:
    """Hand the unembedding an input with compact strides (a speed fix, not an intervention: values are unchanged).

    With ``logits_to_keep=1`` transformers passes ``hidden[:, -1:, :]``, a strided view, to the
    unembedding; on CPU (MKL) ``linear`` on that view takes 6x as long as on a contiguous copy
    (SmolLM2, 32 rows: 175 ms against 27 ms), a third of a small batch's forward. One row's view counts as
    contiguous (its sizes of 1 hide its strides) but keeps them, and a bfloat16 ``linear`` reads them: LLaMA-7B's
    width, one row, 2 s against 0.04 s for a copy. So the input is copied wherever its strides are not compact."""
    head = hf_model.get_output_embeddings() if hasattr(hf_model, "get_output_embeddings") else None
    if isinstance(head, torch.nn.Module):
        head.register_forward_pre_hook(
            lambda _, args: (compact(args[0]), *args[1:]) if args and not is_compact(args[0]) else None
        )


def is_compact(t: torch.Tensor) -> bool:
    """Whether ``t``'s strides are those of a new contiguous tensor of its shape, sizes of 1 included."""
    step, expected = 1, []
    for size in reversed(t.shape):
        expected.append(step)
        step *= size
    return t.stride() == tuple(reversed(expected))


def compact(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` with compact strides (`is_compact`)."""
    return t.clone(memory_format=torch.contiguous_format)


def _load_weights(
    spec: ModelSpec, dtype: torch.dtype, device_map: Any, cache_dir: Optional[str], attn_implementation: str
) -> tuple[Any, dict]:
    from transformers import AutoModelForCausalLM

    common = dict(dtype=dtype, device_map=device_map, attn_implementation=attn_implementation)
    if device_map is not None and (
        isinstance(device_map, dict) or device_map in ("auto", "balanced", "balanced_low_0", "sequential")
    ):
        # accelerate may offload what the GPUs cannot hold to disk: one folder per load, never shared
        import tempfile

        common["offload_folder"] = tempfile.mkdtemp(prefix="mechdiff-offload-")
    src = resolve_source(spec.source)
    if spec.kind == "lora":
        from peft import PeftModel

        base_spec = resolve_spec(spec.base)
        base_model, base_prov = _load_weights(base_spec, dtype, device_map, cache_dir, attn_implementation)
        peft_model = PeftModel.from_pretrained(base_model, src, revision=spec.revision)
        adapter_cfg = peft_model.peft_config["default"].to_dict()
        merged = peft_model.merge_and_unload()
        return merged, {
            "kind": "lora",
            "adapter": spec.source,
            "merged": True,
            "base": base_prov,
            "lora": {k: _jsonable(adapter_cfg.get(k)) for k in ("r", "lora_alpha", "target_modules")},
        }
    if spec.kind == "gguf":
        where, kwargs = converted(src, spec.gguf_file)
        m = AutoModelForCausalLM.from_pretrained(where, **kwargs, **common)
        return m, {"kind": "gguf", "path": str(Path(src) / spec.gguf_file)}
    if spec.kind == "hub":
        m = AutoModelForCausalLM.from_pretrained(
            src, revision=spec.revision, cache_dir=cache_dir, local_files_only=offline(), **common
        )
        return m, {"kind": "hub", "repo": src, "revision": spec.revision}
    m = AutoModelForCausalLM.from_pretrained(src, **common)
    return m, {"kind": "local", "path": src}


def _jsonable(value: Any) -> Any:
    return sorted(value) if isinstance(value, (set, frozenset)) else value


def _ends(path: Path, size: int, chunk: int = 8 << 20) -> bytes:
    """A large file's size and its first and last ``chunk`` bytes (headers and tensors at both ends)."""
    with open(path, "rb") as fh:
        head = fh.read(chunk)
        fh.seek(max(size - chunk, 0))
        return f"{size}:".encode() + hashlib.sha256(head + fh.read(chunk)).digest()


def spec_digest(spec: ModelSpec) -> str:
    """A cheap digest of where a checkpoint comes from, without loading it (keys stage caches).

    Files are hashed when small (adapters, configs); large weight files by name, size and their
    first and last 8 MiB, so that the digest is the same wherever the file is installed. Taken once per
    process for each set of files (names, sizes and change times): a study keys many stages by it.
    """
    src = Path(resolve_source(spec.source))
    files = tuple(_stat(f) for f in sorted(src.iterdir()) if f.is_file()) if src.is_dir() else ()
    base = spec_digest(resolve_spec(spec.base)) if spec.kind == "lora" else ""
    return _digest(spec.kind, spec.source, spec.revision, spec.gguf_file, str(src), files, base)


def _stat(path: Path) -> tuple[str, int, int]:
    stat = path.stat()
    return path.name, stat.st_size, stat.st_mtime_ns


@lru_cache(maxsize=256)
def _digest(kind: str, source: str, revision: Any, gguf_file: Any, src: str, files: tuple, base: str) -> str:
    """`spec_digest` of the files ``files`` (name, size, change time) of the directory ``src``."""
    h = hashlib.sha256(json.dumps([kind, source, revision, gguf_file]).encode())
    for name, size, _ in files:
        h.update(name.encode())
        h.update((Path(src) / name).read_bytes() if size < 64 << 20 else _ends(Path(src) / name, size))
    if kind == "lora":
        h.update(base.encode())
    return h.hexdigest()[:16]
