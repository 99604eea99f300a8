#!/usr/bin/env bash
# Rebuild the embedded SmolLM2 checkpoint family in mechdiff/zoo/ and its evaluation table.
# CPU, float32, one torch thread (the thread count is part of bit-for-bit reproducibility; the
# recipes record it with the torch/transformers/peft versions). Takes about an hour and a half on 2 free cores.
set -euo pipefail
cd "$(dirname "$0")/.."
MECHDIFF=${MECHDIFF:-mechdiff}
EARLY_STEP=${EARLY_STEP:-15}
LATE_STEP=${LATE_STEP:-100}

# 1. One entity-tracking run on smollm2-135m (train-split objects, 2-7 boxes); two checkpoints.
$MECHDIFF finetune --base smollm2-135m --task entity-tracking --out mechdiff/zoo \
  --save "smollm2-et-early=${EARLY_STEP},smollm2-et=${LATE_STEP}" --steps "${LATE_STEP}" \
  --rank 8 --alpha 16 --lr 1e-3 --batch 16 --seed 0 --data-seed 0 \
  --eval-every 10 --eval-steps 5,15,25,35 --eval-n 100 --threads 1
rm -f mechdiff/zoo/history.json

# 1b. The trajectory smollm2-et@STEP: the same recipe rerun, saving seventeen steps (OUT/step-NNNN). The check
#     compares steps 15 and 100 with the adapters of step 1 (results/zoo/trajectory.json), then installs steps
#     1-100 in mechdiff/zoo/smollm2-et-trajectory/ (step 0 is the base: a fresh LoRA's B is zero). The committed
#     steps came from two runs of this recipe: steps 0,5,...,100 from one to step 100, and steps 1,2,3,4,6,8,12
#     from a rerun to step 12 (`--steps 12`, added by `zoo_trajectory.py --add`, which checked its steps 5 and 10
#     bit for bit against the installed ones).
TRAJECTORY_STEPS=0,1,2,3,4,5,6,8,10,12,15,20,30,45,60,80,100
TRAINING="--rank 8 --alpha 16 --lr 1e-3 --batch 16 --eval-every 10 --eval-steps 5,15,25,35 --eval-n 100 --threads 1"
rm -rf /tmp/mechdiff-zoo-trajectory
$MECHDIFF finetune --base smollm2-135m --task entity-tracking --out /tmp/mechdiff-zoo-trajectory \
  --save "$TRAJECTORY_STEPS" --steps 100 $TRAINING --seed 0 --data-seed 0 --stop-accuracy 0.96
python scripts/zoo_trajectory.py /tmp/mechdiff-zoo-trajectory --out results/zoo/trajectory.json

# 1c. The between-run null of the trajectory study: the recipe with four other seeds (LoRA initialisation and data
#     order); only the steps the study reads are kept, in checkpoints/ (outside the installed package).
for SEED in 1 2 3 4; do
  rm -rf /tmp/mechdiff-seed$SEED
  $MECHDIFF finetune --base smollm2-135m --task entity-tracking --out /tmp/mechdiff-seed$SEED \
    --save "$TRAJECTORY_STEPS" --steps 100 $TRAINING --seed $SEED --data-seed $SEED --stop-accuracy 0.96
  rm -rf checkpoints/smollm2-et-seed$SEED && mkdir -p checkpoints/smollm2-et-seed$SEED
  for STEP in 2 5 15 45 100; do
    cp -r /tmp/mechdiff-seed$SEED/step-$(printf %04d $STEP) checkpoints/smollm2-et-seed$SEED/
  done
done

# 2. smollm2-et-early (merged) + a new LoRA trained on arithmetic only.
$MECHDIFF finetune --base smollm2-et-early --task arithmetic --out /tmp/mechdiff-zoo-math \
  --save smollm2-et-math=60 --steps 60 \
  --rank 8 --alpha 16 --lr 1e-3 --batch 16 --seed 0 --data-seed 1 \
  --eval-every 25 --eval-n 100 --threads 1
rm -rf mechdiff/zoo/smollm2-et-math && mv /tmp/mechdiff-zoo-math/smollm2-et-math mechdiff/zoo/

# 2b. smollm2-135m + a LoRA that rewrites four capitals (edits/capital_swap) and keeps the others: the
#     knowledge circuits' editing analysis (`mechdiff knowledge-edit`).
$MECHDIFF finetune --base smollm2-135m --task fact-edit --out /tmp/mechdiff-zoo-edit \
  --save smollm2-capital-edit=60 --save-every 20 --steps 60 \
  --rank 4 --alpha 8 --targets q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj \
  --lr 1e-3 --batch 16 --eval-every 10 --eval-n 50 --threads 1
rm -rf mechdiff/zoo/smollm2-capital-edit && mv /tmp/mechdiff-zoo-edit/smollm2-capital-edit mechdiff/zoo/

# 3. The held-out table (eval-split objects, 7 boxes, seed 0, 500 prompts); per-prompt results included.
$MECHDIFF eval --model smollm2-135m,smollm2-et-early,smollm2-et,smollm2-et-math --split eval \
  --n 500 --n-boxes 7 --seed 0 --out results/zoo/eval-500.json
# 3b. The trajectory's steps 15 and 100 on the same prompts (the reproduction check in results/zoo/README.md).
$MECHDIFF eval --model smollm2-et@15,smollm2-et@100 --split eval \
  --n 500 --n-boxes 7 --seed 0 --out results/zoo/eval-500-trajectory.json
