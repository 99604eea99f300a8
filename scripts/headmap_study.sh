#!/usr/bin/env bash
# The HeadMap study on SmolLM2-135M (results/headmap-smollm2/): locate on entity tracking and on the
# multiple-choice arithmetic task, HeadMap vs LoRA with ablations, overlap with the path-patching circuits.
# Its settings are tasks/headmap.toml. Every stage is cached in results/headmap-smollm2/stages/, so a rerun
# only redoes what changed.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1
nice -n 10 mechdiff headmap compare --task tasks/headmap.toml --out results/headmap-smollm2 --threads 2 "$@"
