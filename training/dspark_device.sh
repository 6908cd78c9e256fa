#!/usr/bin/env bash
# Train k3-tiny's DSpark drafter on one GPU in a fixed wall budget (docs/dspark.md, "Training"): generate
# k3-tiny's own greedy continuations of training-split stdlib code (k3rt's engine: continuous batching of 512
# requests, GPU runner with decode CUDA graphs), take a cheap corpus sample beside them, train the drafter on
# both (states captured by one dense forward when train loads the data; the prompts of 3% of the training
# split's documents held out and their tau logged against the training prompts', the best held-out weights
# kept), then measure held-out tau at
# k = 7, temperature 0, with the n-gram baseline on the same continuations. Run from the repository root on
# the device machine:
#
#   OUT=/path/to/out bash training/dspark_device.sh
#
# Phases and their hard limits (seconds, `timeout`): setup 40 (wheels in .whl/, editable install), gen 180
# (--minutes 1.8 of generation inside, plus model load, Triton compiles and graph capture; token ids only;
# should it fail, gen-dense, 1.5 minutes of the first run's dense path, replaces it),
# corpus 50 (a few seconds of dense forwards over corpus windows), train 270 (states capture ~30 s, then
# --minutes 3.0 of steps), eval 70, card 20: at most 630 s, about 7.5 minutes expected (the device tool
# allows 600 s per command). Each phase's own
# budget ends it before its timeout; the timeout only backs that up. Progress (tqdm, every 15 s) and the
# train phase's held-in / held-out-split tau (every 20 s) go to the log; each phase's start, end and
# seconds to stdout too.
# Outputs (6 files): $OUT/k3-tiny-dspark/{config.json, model.safetensors (bf16, ~8.7 MB), training.json
# (with the held-in/held-out curve), README.md (the card: shape, training, held-out tau table)},
# $OUT/eval.json (held-out tau, tau_scheduled, ngram_tau), $OUT/dspark_device.log (every phase's output;
# gen's last line gives sequences per minute).
# Ship it: copy the four files of $OUT/k3-tiny-dspark/ over k3rt/models/k3-tiny-dspark/.
#
# DSPARK_GENBENCH=1 first runs `dspark genbench` (~2 minutes more, limit 120 s): the engine's and the dense
# path's continuations checked against the cached path's on 8 prompts, then each path's sequences per
# minute at the real shapes (JSON + table in the log, the table on stdout too). Standalone:
#   python -m k3rt.training.dspark genbench --device cuda --budget-s 90
#
# Smoke test on a CPU (about 1.5 minutes): everything scaled down, same code path (the engine on the
# reference runner instead of the GPU runner).
#   OUT=/tmp/dspark_smoke DSPARK_SMOKE=1 DSPARK_PYTHON=.venv/bin/python bash training/dspark_device.sh
set -u -o pipefail
OUT=${OUT:-./dspark_out}
mkdir -p "$OUT/k3-tiny-dspark"
LOG="$OUT/dspark_device.log"
WORK=${DSPARK_WORK:-/tmp/dspark_work}
mkdir -p "$WORK"
PY=${DSPARK_PYTHON:-python3}
export PYTHONUNBUFFERED=1 TQDM_MININTERVAL=${TQDM_MININTERVAL:-15} OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
if [ "${DSPARK_SMOKE:-0}" = 1 ]; then
  # CPU smoke test: same phases, tiny sizes
  DEV=cpu GEN_MIN=0.3 GEN_TO=90 CORPUS_TO=60 TRAIN_MIN=0.4 TRAIN_TO=90 EVAL_TO=60
  GEN_ARGS="--max-prompts 16 --batch 8 --gen-len 48 --holdout-docs 0.2" CORPUS_ARGS="--max-prompts 16 --batch 8 --gen-len 48"
  TRAIN_ARGS="--batch 16 --holdout-anchors 256 --eval-every 10" EVAL_ARGS="--num-prompts 4 --gen-len 40"
else
  DEV=cuda GEN_MIN=1.8 GEN_TO=180 CORPUS_TO=50 TRAIN_MIN=3.0 TRAIN_TO=270 EVAL_TO=70
  # 512 requests in flight, 48 prompt + 160 greedy tokens each (the eval continues 48 -> 96); the prompts
  # of 3% of the training split's documents come first and train holds them out (--holdout-docs default)
  GEN_ARGS="--max-prompts 32768 --batch 512 --gen-len 160"
  CORPUS_ARGS="--max-prompts 8192 --batch 256 --gen-len 160"
  # ~25K greedy sequences (5M anchors) against ~10K steps of 512: under one epoch; the corpus windows add
  # contexts the greedy continuations lack; weight decay and the best held-out weights guard the rest
  TRAIN_ARGS="--batch 512 --lr 2e-3 --warmup 200 --weight-decay 0.05 --data-weights 0.85 0.15"
  EVAL_ARGS="--num-prompts 32 --gen-len 96"
fi
phase() {  # name, timeout, command...: run it under its limit, log it, say how long it took
  local name=$1 limit=$2 t0=$SECONDS
  shift 2
  echo "== $name (limit ${limit}s) $(date -u +%H:%M:%S)" | tee -a "$LOG"
  timeout "$limit" "$@" >>"$LOG" 2>&1
  local rc=$?
  echo "== $name done rc=$rc in $((SECONDS - t0))s" | tee -a "$LOG"
  return $rc
}
: >"$LOG"
if [ "${DSPARK_INSTALL:-1}" = 1 ]; then
  phase setup 40 bash -c '
    if ls .whl/*.whl >/dev/null 2>&1; then
      '"$PY"' -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    fi
    '"$PY"' -m pip install -q --no-build-isolation --no-deps -e .'
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# k3rt's imports (orjson from .whl; safetensors, tokenizers, tqdm from the image), and the GPU
"$PY" -c "
import orjson, safetensors, tokenizers, tqdm, torch, sys
import k3rt.training.dspark
ok = '$DEV' == 'cpu' or torch.cuda.is_available()
print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.cuda.is_available())
sys.exit(0 if ok else 3)" 2>&1 | tee -a "$LOG" || { echo "imports or GPU missing (see $LOG)" >&2; exit 2; }

if [ "${DSPARK_GENBENCH:-0}" = 1 ]; then  # optional, ~90 s more: the greedy paths checked, then timed
  if [ "$DEV" = cpu ]; then GB_ARGS="--budget-s 40 --prompts 16 --batch 8 --dense-batch 8 --gen-len 48"
  else GB_ARGS="--budget-s 75 --prompts 1024 --batch 512 --dense-batch 256 --gen-len 160"; fi
  # shellcheck disable=SC2086
  phase genbench 120 "$PY" -m k3rt.training.dspark genbench --device "$DEV" $GB_ARGS || exit 1
  grep -A6 '^check:' "$LOG"
fi
# if the engine path fails on the device, the dense path of the first run makes a smaller data set instead
# shellcheck disable=SC2086  # the *_ARGS hold several arguments
phase gen "$GEN_TO" "$PY" -m k3rt.training.dspark gen --source greedy --greedy-path engine --split train \
  --device "$DEV" --minutes "$GEN_MIN" --out "$WORK/greedy.pt" --seed 1 --no-states $GEN_ARGS ||
  phase gen-dense "$GEN_TO" "$PY" -m k3rt.training.dspark gen --source greedy --greedy-path dense --split train \
    --device "$DEV" --minutes 1.5 --out "$WORK/greedy.pt" --seed 1 --no-states $GEN_ARGS --batch 256 ||
  exit 1
# shellcheck disable=SC2086
phase corpus "$CORPUS_TO" "$PY" -m k3rt.training.dspark gen --source corpus --split train --device "$DEV" \
  --minutes 0.5 --out "$WORK/corpus.pt" --seed 2 --no-states $CORPUS_ARGS || exit 1
# shellcheck disable=SC2086
phase train "$TRAIN_TO" "$PY" -m k3rt.training.dspark train --data "$WORK/greedy.pt" "$WORK/corpus.pt" \
  --device "$DEV" --minutes "$TRAIN_MIN" --out "$OUT/k3-tiny-dspark" $TRAIN_ARGS || exit 1
# shellcheck disable=SC2086
phase eval "$EVAL_TO" "$PY" -m k3rt.training.dspark eval --drafter "$OUT/k3-tiny-dspark" --device "$DEV" \
  --out "$OUT/eval.json" $EVAL_ARGS || exit 1
phase card 20 "$PY" -m k3rt.training.dspark card --drafter "$OUT/k3-tiny-dspark" --eval "$OUT/eval.json"
echo "== total ${SECONDS}s" | tee -a "$LOG"
cat "$OUT/eval.json"
