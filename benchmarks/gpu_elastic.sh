#!/usr/bin/env bash
# Issue 8/9 on a machine with 2 GPUs (or CPUs with CPU=--cpu): NCCL training in every layout 2 GPUs allow, then an
# elastic story: 2 GPUs (ep=2) -> lose one, resume on 1 GPU (resharded at load) -> grow back to 2 (ep=2).
# Usage: MODEL=zaya-small OUT=dir bash benchmarks/gpu_elastic.sh ; then python benchmarks/plot_elastic.py OUT
set -euo pipefail
MODEL=${MODEL:-zaya-small}
OUT=${OUT:-/tmp/gpu-elastic}
WORK=${WORK:-/tmp/gpu-elastic-runs}
STEPS=${STEPS:-30}
COMMON=(--model "$MODEL" --global-batch ${BATCH:-16} --seq-len ${SEQ:-512} --dtype ${DTYPE:-bf16} --lr 1e-3 --warmup-steps 5 --seed 7 ${CPU:-})
M=(python3 -m moeckpt.cli.main)
mkdir -p "$OUT"; rm -rf "$WORK"; mkdir -p "$WORK"

for layout in "1 1" "1 2" "2 1"; do
  set -- $layout; tp=$1; ep=$2
  name="layout-tp${tp}-ep${ep}-dp$((2 / tp))"
  echo "== $name"
  "${M[@]}" train "${COMMON[@]}" --run-dir "$WORK/$name" --nproc 2 --tp $tp --ep $ep --steps $STEPS --save-every $STEPS
  cp "$WORK/$name/metrics.jsonl" "$OUT/$name.jsonl"
done

R="$WORK/elastic"
T=$((2 * STEPS))
echo "== elastic phase 1: 2 workers, ep=2, until step $((T / 3))"
"${M[@]}" train "${COMMON[@]}" --run-dir "$R" --nproc 2 --ep 2 --steps $T --save-every 5 --stop-at $((T / 3))
cp "$R/metrics.jsonl" "$OUT/elastic-1.jsonl"
echo "== elastic phase 2: a GPU is lost; 1 worker resumes (resharded ep=2,dp=2 -> 1,1,1) until step $((2 * T / 3))"
t0=$SECONDS
"${M[@]}" train "${COMMON[@]}" --run-dir "$R" --nproc 1 --steps $T --save-every 5 --stop-at $((2 * T / 3))
echo "phase 2 wall (process start to exit, resume included): $((SECONDS - t0)) s"
cp "$R/metrics.jsonl" "$OUT/elastic-2.jsonl"
echo "== elastic phase 3: grow back to 2 workers, ep=2, until step $T"
"${M[@]}" train "${COMMON[@]}" --run-dir "$R" --nproc 2 --ep 2 --steps $T --save-every 5
cp "$R/metrics.jsonl" "$OUT/elastic-3.jsonl"
"${M[@]}" inspect "$R" | head -8
