#!/usr/bin/env bash
# The fp4sense CLI from diagnosis to a Hub-ready checkpoint, one command a step.
#
#   bash examples/cli_walkthrough.sh                 # the bundled SmolLM2 and text
#   MODEL=org/name bash examples/cli_walkthrough.sh  # any hub id or local folder
#
# Knobs (environment): MODEL, TEXT (a text file), OUT (default fp4sense-walkthrough),
# WINDOWS and TOKENS (window count and length), BUDGET (bits per weight, default 4.75),
# REPO_ID (for the push dry run), VLLM=0 to skip the vLLM check.
set -euo pipefail

FP4SENSE=${FP4SENSE:-fp4sense}
OUT=${OUT:-fp4sense-walkthrough}
WINDOWS=${WINDOWS:-4}
TOKENS=${TOKENS:-512}
BUDGET=${BUDGET:-4.75}
REPO_ID=${REPO_ID:-your-name/model-fp4sense}
MODEL_ARG=(${MODEL:+"$MODEL"})
TEXT_ARG=(${TEXT:+--text "$TEXT"})

# 1. which units can live in FP4? measured component and block views for NVFP4 and
#    MXFP4, plus the one-pass estimate of the whole unit x scheme grid
"$FP4SENSE" analyze "${MODEL_ARG[@]}" "${TEXT_ARG[@]}" --schemes NVFP4,MXFP4 \
  --views component,block,grid --mode both --grid-blocks "" \
  --analysis-windows "$WINDOWS" --tokens "$TOKENS" --out "$OUT/analysis"
echo "report: $OUT/analysis/report.md"

# 2. plan at the budget over the menu {NVFP4, FP8_DYNAMIC, BF16} (the sensitivities of
#    that menu are estimated on the calibration windows; --sensitivity takes a saved
#    report instead), quantize with llm-compressor, evaluate for the model card
"$FP4SENSE" quantize "${MODEL_ARG[@]}" "${TEXT_ARG[@]}" --budget "$BUDGET" \
  --menu NVFP4,FP8_DYNAMIC,BF16 --calib-windows "$WINDOWS" --analysis-windows "$WINDOWS" \
  --tokens "$TOKENS" --eval-windows "$WINDOWS" --out "$OUT/checkpoint" --overwrite

# 3. the checkpoint on its own: quality against the base model, bits read from the file
"$FP4SENSE" eval "$OUT/checkpoint" "${TEXT_ARG[@]}" --eval-windows "$WINDOWS" --tokens "$TOKENS" \
  --json > "$OUT/eval.json"
echo "eval: $OUT/eval.json"

# 4. does vLLM load it and compute what transformers computes?
if [ "${VLLM:-1}" != 0 ]; then
  "$FP4SENSE" verify-vllm "$OUT/checkpoint" "${TEXT_ARG[@]}" --eval-windows 1 \
    --tokens "$(( TOKENS < 512 ? TOKENS : 512 ))"
fi

# 5. ready for the Hub: every check, and the exact list of files (drop --dry-run to upload)
"$FP4SENSE" push "$OUT/checkpoint" --repo-id "$REPO_ID" --dry-run
