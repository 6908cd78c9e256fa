#!/usr/bin/env bash
# Train k3-tiny recipes side by side on the device tool's machine, one GPU per recipe, each run under the
# same time budget; each export comes back as one archive (the device returns at most 8 files per call).
#
#   bash scripts/train_on_device.sh <time-budget-s> <commit> "<name>:<extra train args>" ...
#   e.g. (2 GPUs; carry .whl and .cache/corpus):
#   bash scripts/train_on_device.sh 500 $(git rev-parse HEAD) "lib:--function-docs library" "all:--function-docs all"
#
# Outputs under $OUT: train-<name>.log and k3-tiny-<name>.tgz (config, shards, tokenizer, training.json).
set -u
budget=$1 commit=$2
shift 2
OUT=${OUT:-./device_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-build-isolation --no-deps -e . >/dev/null 2>&1
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
[ "$#" -le "$gpus" ] || { echo "$# recipes for $gpus GPU(s)" >&2; exit 2; }
i=0
for recipe in "$@"; do
  name=${recipe%%:*} extra=${recipe#*:}
  # shellcheck disable=SC2086  # extra holds several arguments
  CUDA_VISIBLE_DEVICES=$i python3 scripts/train_default_model.py --device cuda --time-budget-s "$budget" \
    --commit "$commit" --out "$OUT/k3-tiny-$name" --work-dir "/tmp/train-$name" $extra \
    >"$OUT/train-$name.log" 2>&1 &
  i=$((i + 1))
done
wait
for recipe in "$@"; do
  name=${recipe%%:*}
  echo "== $name: $(grep -E 'calibrated|training stopped|exporting|held-out bits|reloaded' "$OUT/train-$name.log" | tr '\n' ' ')"
  tail -3 "$OUT/train-$name.log"
  [ -d "$OUT/k3-tiny-$name" ] && tar czf "$OUT/k3-tiny-$name.tgz" -C "$OUT" "k3-tiny-$name" && rm -rf "$OUT/k3-tiny-$name"
done
