#!/usr/bin/env bash
# The HeadMap study on SmolLM2-135M (results/headmap-smollm2/): locate on entity tracking and on the
# multiple-choice arithmetic task, HeadMap vs LoRA with ablations, overlap with the path-patching circuits.
# Every stage is cached in results/headmap-smollm2/stages/, so a rerun only redoes what changed.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1
PP=results/entity-tracking-smollm2/circuits
nice -n 10 mechdiff headmap compare --model smollm2-135m --out results/headmap-smollm2 \
  --n 8 --pool 64 --k 2 --batch-size 40 --rank 4 --steps 20 --batch 16 --lr 1e-3 --headmap-lr 5e-3 \
  --eval-n 150 --lora-small 1 --lora-large 8 --threads 2 --runs base,located,random,outside,lora-zoo,lora-small,headmap+lora,transfer \
  --path-patching "$PP/smollm2-et-early.pruned.json,$PP/smollm2-et-early.json" "$@"
