#!/usr/bin/env bash
# Train k3-tiny recipes side by side on the device tool's machine, each run under the same time budget,
# spread round-robin over the GPUs (a training step of this 12M-parameter model is bound by kernel launches,
# so a few recipes can share one GPU). The device returns at most 8 files of at most 16 MiB each, so an
# export comes back as its weight shards (each <= 15 MB) plus one archive of its small files and training
# log: 3 files per recipe, and with more than two recipes only the best ones (validation function test) keep
# their shards.
#
#   bash scripts/train_on_device.sh <time-budget-s> <commit> "<name>:<extra train args>" ...
#   e.g. (carry .whl and .cache/corpus):
#   bash scripts/train_on_device.sh 400 $(git rev-parse HEAD) "lib:--function-docs library" "all:--function-docs all"
#   (the call also needs ~20 s of set-up and ~2 min for the two function-completion tests after training;
#   EVAL_SPLITS=valid runs only the validation one, the one recipes are chosen by, EVAL_SPLITS=none neither;
#   EVAL_TIMEOUT=<s> bounds each test, so that the packing below always runs inside the call's limit).
#   A name ending in @N ("full@0:...") pins that recipe to GPU N instead of the round-robin.
#
# Outputs under $OUT/k3-tiny-<name>/: model-*.safetensors and small-files.tgz (config.json, the shard index,
# tokenizer files, training.json, train.log, and eval-valid.json / eval-heldout.json: the function-completion
# test on the validation and the held-out modules, run on the GPU right after training, so a recipe's parse
# rate is known even if its weights cannot come back. Choose between recipes by the validation one; the CPU
# run of scripts/eval_default_model.py on the chosen export stays the reported number). Unpack with:
# tar xzf small-files.tgz -C <that folder>.
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
[ "$gpus" -ge 1 ] || { echo "no GPU" >&2; exit 2; }
i=0
gpu_of() {  # recipe index -> GPU: the name's @N, else round-robin
  case ${1%%:*} in *@*) echo "${1%%:*}" | sed 's/.*@//' ;; *) echo $(($2 % gpus)) ;; esac
}
for recipe in "$@"; do
  gpu=$(gpu_of "$recipe" "$i")
  name=${recipe%%:*} extra=${recipe#*:}
  name=${name%@*}
  # shellcheck disable=SC2086  # extra holds several arguments
  CUDA_VISIBLE_DEVICES=$gpu python3 scripts/train_default_model.py --device cuda --time-budget-s "$budget" \
    --commit "$commit" --out "$OUT/k3-tiny-$name" --work-dir "/tmp/train-$name" $extra \
    >"/tmp/train-$name.log" 2>&1 &
  i=$((i + 1))
done
wait
i=0
for recipe in "$@"; do  # the function-completion tests of each export, side by side like the trainings
  gpu=$(gpu_of "$recipe" "$i")
  name=${recipe%%:*}
  name=${name%@*}
  [ -d "$OUT/k3-tiny-$name" ] && [ "${EVAL_SPLITS:-}" != none ] && for split in ${EVAL_SPLITS:-valid heldout}; do
    CUDA_VISIBLE_DEVICES=$gpu timeout "${EVAL_TIMEOUT:-600}" python3 scripts/eval_default_model.py --model "$OUT/k3-tiny-$name" --device cuda \
      --skip-bpb --function-split $split --out "$OUT/k3-tiny-$name/eval-$split.json" >>"/tmp/train-$name.log" 2>&1
  done &
  i=$((i + 1))
done
wait
# the device returns at most 8 files: weights come back for as many recipes as fit (2 shards + 1 archive
# each, the rest 1 archive each), best first by the validation function test (complete_rate), then its
# looser parse_rate, then validation bits/byte; without eval-valid.json, by the training run's own
# validation function test of the exported checkpoint
keep=$(python3 - "$OUT" "$@" <<'PY'
import json, sys
from pathlib import Path
out, names = Path(sys.argv[1]), [r.split(":", 1)[0].split("@")[0] for r in sys.argv[2:]]
def score(name):
    d = out / f"k3-tiny-{name}"
    try:
        fc = json.loads((d / "eval-valid.json").read_text())["function_completion"]
        complete, parse = fc["complete_rate"], fc["parse_rate"]
    except (OSError, KeyError, ValueError):
        try:
            fc = json.loads((d / "training.json").read_text())["valid_function_test_exported"]
            complete, parse = fc["valid_complete"], fc["valid_parse"]
        except (OSError, KeyError, ValueError, TypeError):
            complete = parse = -1.0
    try:
        bpb = json.loads((d / "training.json").read_text())["valid_bits_per_byte_exported"]
    except (OSError, KeyError, ValueError):
        bpb = float("inf")
    return (-complete, -parse, bpb)
ranked = sorted(names, key=score)
n = max(k for k in range(len(names) + 1) if 3 * k + (len(names) - k) <= 8)
print(" ".join(ranked[:n]))
PY
)
echo "weights come back for: ${keep:-none} (best first by validation function test)"
for recipe in "$@"; do
  name=${recipe%%:*}
  name=${name%@*}
  log=/tmp/train-$name.log dir=$OUT/k3-tiny-$name
  echo "== $name: $(grep -E 'calibrated|training stopped|exporting|held-out bits|reloaded|function completion' "$log" | tr '\n' ' ')"
  tail -3 "$log"
  [ -d "$dir" ] || { cp "$log" "$OUT/train-$name.log"; continue; }
  cp "$log" "$dir/train.log"
  small=$(cd "$dir" && ls | grep -v '\.safetensors$')
  # shellcheck disable=SC2086  # one name per word
  (cd "$dir" && tar czf small-files.tgz $small && rm -f $small)
  case " $keep " in *" $name "*) ;; *) rm -f "$dir"/*.safetensors ;; esac
done
