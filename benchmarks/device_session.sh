#!/usr/bin/env bash
# One device call's worth of GPU checks and benchmarks, in stages, each under its own time limit, each
# writing its log (and JSON) under $OUT so a stage cut short keeps what it printed and the call still
# returns the rest. Meant for the device tool's machine (torch + triton in the image's python3, no
# internet); run from the repository root, with the carried wheels in .whl/ (fla for the KDA peer).
#
#   bash benchmarks/device_session.sh tests decode            # the GPU tests, then the 48B decode benchmark
#   bash benchmarks/device_session.sh tests-runner kda mla    # stages run in the order given
#
# The 48B-shape stages (decode, kda-forms-48b, overlap, serve, spec-verify, det's second part) need an H200: the
# shape's random bf16 weights are 91.5 GiB, refused up front on an 80 GB H100 (random_model's check_weights_fit).
#
# Stages (seconds: the stage's time limit):
#   tests-runner (540)  GPU tests of the runner, engine, cache oracle and MoE block (tests/backend, ~460 s in
#                       session 12; the engines there also capture the piecewise graphs of steps with prefill rows)
#   tests-kernels (590) GPU tests of every kernel package (tests/kernels), one pytest per package, so a
#                       broken CUDA context in one (an illegal memory access poisons the process) does
#                       not fail the others (moe 90 s: the MXFP4 kernels' variants compile too)
#   tests               both of the above
#   decode (200)        benchmarks/decode.py: batch 1/16/64 at 4K, --profile 1, prefill 8K and 32K (the defaults,
#                       then the KDA fused intra step, the default before session 32), batch 1's MoE in two launches,
#                       and without the residual add and next norm in the MoE's sum launch (session 38, no_sum_add_norm),
#                       and batch 1's KDA output norm finished in o_proj's launch (session 39, kda_norm_in_o_proj),
#                       and batch 1's MoE and KDA layers in one persistent launch each, MLA's in two around its core
#                       (session 40: moe_layer_one_token, kda_layer_one_token, mla_layer_one_token; all: layers_one_token)
#   moe-layer (150 + 150) one token's MoE layer in one persistent launch (session 40, built without a GPU): its GPU
#                       tests (the grid form from a graph at every tile candidate, against the grouped path), then
#                       kernels_moe.py --layer-only: the runner's five launches against it at the 48B layer's shape
#   kda-layer (150 + 150 + 100) one token's KDA layer in one persistent launch, MLA's in two around mla_decode
#                       (session 40, built without a GPU): their GPU tests (the grid forms from a graph, KDA's at every
#                       tile candidate, bit-equal to the phased forms), then benchmarks/kda_layer.py and
#                       benchmarks/mla_layer.py: the runner's separate launches against them at the 48B's shapes
#   kda (240)           benchmarks/kernels.py: KDA decode (N = 1, 16) and prefill against fla, the fused and the
#                       blocks intra path (kda_chunk_fwd intra="blocks", session 30) side by side
#   kda-blocks (120 + 200) the chunk kernels' GPU tests (the blocks cases, fp32 scratch), then the blocks path's
#                       sweep at 16K without fla (warps, sliced W/U, per-block L, 64-column slices)
#   kda-warps (250)     the blocks path at its default 2 warps against 4, beside fla, at 16K / 64K / 8 x 4K (issue
#                       18's >= 1.2x fla goal; session 33's 130 s budget ended before fla's 64K and 8 x 4K cases)
#   kda-multi (120 + 220 + 180) the verify graphs' KDA (kda_decode_multi) on the GPU: its tests (the hoisted form
#                       within an fp32 ulp of the decode kernel), benchmarks/kda_multi.py: token loop vs hoist (session
#                       33, built without a GPU) at k3-tiny's and the 48B's KDA shapes, warps and V splits, then k3-tiny's
#                       verify and commit graphs with each (spec_verify.py --variants multi multi_hoist)
#   kda-fused-gc (150 + 340) the blocks intra path without its Gc launch (KernelConfig.kda_blocks_fuse_gc,
#                       session 33), with its inverse in registers, L and W/U per chunk (kda_blocks_inverse_regs,
#                       kda_blocks_l_chunk, kda_blocks_out_chunk, session 34), all built without a GPU: the chunk
#                       tests on CUDA, then kernels.py at 16K / 64K / 8 x 4K, fla right after the default (issue
#                       18's >= 1.2x fla), 16-column K slices and the fused-Gc L launch under register caps (session
#                       35: every form lost to the default on the H100, fused Gc by 30% at 254 registers), each form
#                       and all four together
#   kda-phases (330 + 90) the blocks path's launch shapes phase by phase (session 36): kernels.py at 16K / 64K /
#                       8 x 4K, fla beside, the default (the rows' norms in L's launch, the inverse at 1 warp) against
#                       the earlier one (norms in the Gc launch, the inverse at 4 warps), W/U one program per chunk (at
#                       3 stages, at 8 warps with 64-column slices: fla's recompute_w_u shape), the Gc launch per K
#                       slice; at 64K alone the inverse at 2 warps, W/U's row blocks at 3 stages; each case also back
#                       to back (b2b: the host's per-call work behind the GPU's) and fla's and the default's kernels
#                       by name (torch.profiler); then the new forms' tests on CUDA
#   kda-default (200 + 150) kernels.py at 8K / 16K / 64K / 8 x 4K: the blocks path's default (session 37: W/U one
#                       program per chunk at 3 stages, Gc per K slice at 2 warps) against session 36's, fla twice
#                       beside (issue 18's >= 1.2x fla); then the chunk tests and the blocks forms' on CUDA
#   kda-decode-probe (120) KDA decode at N = 1 over the split-head shapes, with timing probes (session 37,
#                       kda_decode(probe=)): without the heads' arrival atomic, without the conv cache, without both;
#                       what each costs of the 5-6 us step (issue 18's N = 1 goal: 4 us)
#   kda-decode (200 + 150) KDA decode at N = 1-64 beside fla, with and without the fused norm; with
#                       DECODE_BASELINE=FILE (an earlier kernels/kda/triton_decode.py, carried to the device) that kernel
#                       too, interleaved (kernels.py --decode-baseline); then the decode sweep at N = 16 and 64 (session
#                       38's split one-warp programs against whole heads; issue 18's >= 80% of the floor at N >= 16)
#   kda-forms-48b (240) the 48B prefill at 8K / 32K with each of those forms and all four (decode.py)
#   bf16-paths (120 + 200) test_gpu_runner_bf16_logits_within_tolerance (session 33: [k3] failed at 8fc76af,
#                       0.0459 against 0.0381), then benchmarks/bf16_paths.py: the bf16 runner's prefill error per
#                       kernel form (its --cpu-bf16 twin on the CPU: every form 0.87-0.96x the reference's error)
#   spec-b16 (230)      issue 16's >= 0.95x at batch 16 and 64 (session 32: agent b16 0.89) at the default 16 rounds
#   spec-b1 (130 + 110) issue 16 at batch 1 with the default 16 rounds: the gate on code and agent, then
#                       spec_round.py plain vs dspark:16 with the prefill steps profiled (session 32: a dspark
#                       request's prefill step 9.1 ms against plain's 5.2, a large share of a 64-token request)
#   mla (240)           benchmarks/kernels_mla.py --decode-only (13 launch variants x 11 cases, then splits); with
#                       MLA_BASELINE=FILE (an earlier kernels/mla/triton_decode.py, carried) that file's mla_decode
#                       too, beside the default at every case, interleaved (session 39: the one-pass combine)
#   mla-gluon (90 + 100) the Gluon MLA decode's GPU tests (both layouts: heads padded to 64, tokens on wgmma's M;
#                       session 43), then kernels_mla.py: the Triton default (one-pass combine) and its two-step
#                       combine, the Gluon heads and tokens layouts, bf16 partials (issue 18's >= 80 % at batch >= 16
#                       and >= 50 % at batch 1 on the H200)
#   decode-mla (240)    benchmarks/decode.py at the 48B shape, batch 1/16/64 at 4K, --profile 1: the default (the
#                       Gluon MLA decode's tokens layout since session 44) against the Triton MLA decode, its
#                       two-step combine, the Gluon heads layout, batch 1's KDA norm in
#                       o_proj, the persistent one-token layers (session 43's variants), the KDA decode with PDL
#                       and its late wait, alone and after the skinny GEMV's early trigger (session 44's
#                       kda_decode_pdl, kda_decode_pdl_trigger; needs the H200)
#   bw-probe (150)      benchmarks/bandwidth_probe.py (session 44): what a kernel with no math reaches on the KDA
#                       decode's states (torch's in-place scale and copy, a Triton read-modify-write in the decode's and
#                       fla's tiles, with and without the delta rule's reductions) at N = 1/16/64 and on the MLA
#                       decode's pages (torch's sum, a Triton paged read) at 1x32K/16x32K/64x32K/16x128K, beside the
#                       kernels: is the H200's ~3 TB/s the access pattern's or the kernels'?
#   kda-pdl (120 + 110) the KDA decode's PDL late wait (session 44): its GPU tests (a graph of decode steps over three
#                       layers against the eager chain without PDL, bit for bit; the runner's step with
#                       kda_decode_pdl), then the N = 1 decode sweep (kernels.py --decode-sweep: PDL with the wait
#                       first and last, the probes; issue 18's 4 us)
#   bw-kda (220)        bandwidth_probe.py at N = 16 / 64 only (and 1x32K): every --kda-tilings row, the value-major
#                       tilings among them (session 45): does a contiguous-column program pass the decode tiles' 77 %?
#   gemv-tests (240)    the GPU tests of session 45's GEMV forms (linear, the MoE GEMV, the runner's step with them)
#   gemv-forms (330)    benchmarks/decode.py at the 48B shape, batch 1: session 45's one-row forms (the default since
#                       session 46, on the H100's 12-layer evidence) off against the default: all of them
#                       (no_gemv_forms), the wide projections on cuBLAS (no_gemv_wide), the grouped experts
#                       (no_moe_gemv); and the gates' up-projection (now the unrolled GEMV) triggering the KDA decode
#                       early (kda_decode_pdl_trigger: session 46's timeline found no overlap after cuBLAS); then
#                       --graph-timeline of control and kda_decode_pdl_trigger (session 47 dropped the variants that
#                       lost on the H200 before and --prefill: the H200 is seldom lent, and this fits one call
#                       with bw-kda)
#   gemv-forms-h100 (330) the same at the 48B's first 12 layers (decode.py --layers 12: 9 KDA + 3 MLA, ~42 GB of
#                       weights), for an H100
#   moe (200)           benchmarks/kernels_moe.py: decode T=1/64, prefill 2K/8K/32K (every tile candidate, the
#                       grouped tiles among them; the alignment alone in both multi-chunk forms), route
#   linear (100)        benchmarks/kernels_linear.py
#   overlap (480)       benchmarks/overlap.py: the engine at the 48B shape, N = 64 and 256 decodes, overlap on vs
#                       off (tokens/s, GPU idle)
#   mxfp4 (150 + 300)   the MXFP4 expert kernels' GPU tests, then benchmarks/kernels_mxfp4.py (K3 expert shape:
#                       every variant x tile config, correctness first, % of copy bandwidth)
#   det (150 + 120 + 300) the --deterministic GPU acceptance test (64 concurrent vs alone, 3 rounds, both archs),
#                       then benchmarks/deterministic.py on the GPU runner: k3-tiny, and the 48B shape (random
#                       weights, 8K vocabulary)
#   serve (470 + 110)   benchmarks/serve_gpu.py: a real `k3rt serve --device cuda` at the 48B shape (random
#                       weights, 8K vocabulary) under `k3rt bench serve` sharegpt (128 tokens), concurrency 1 and 64
#                       and Poisson 16 req/s, overlap on and off; then benchmarks/decode.py --batch 64 (the pure
#                       decode rate to compare with; --mixed: 64 decodes + one prefill chunk, eager). Needs
#                       fastapi/uvicorn/pydantic/opentelemetry-api wheels in .whl/
#   k3-launches (200 + 90 + 150) GPU tests of session 31's launch cuts (MLA gate kernel, the router's logits in
#                       its top-k launch, LatentMoE's fused projections and norm in the experts' sum), the device
#                       kernels per k3-tiny forward (benchmarks/launches.py), then k3-tiny's decode graphs (random
#                       weights) at batch 1/4/16 with each cut switched off beside the default (and K3's residual mix in
#                       its stacked form, off since session 33)
#   spec-tests (300)    the speculative decoding GPU tests (verify graphs and the drafter's graphs against eager,
#                       greedy identity, taps inside the graphs, the device rounds on CUDA graphs; test_spec,
#                       test_dspark_engine, test_spec_deterministic, test_spec_rounds)
#   spec-verify (300)   benchmarks/spec_verify.py: 48B shape, a 1 + 7 verify step vs a plain step at 4K, batch 1
#                       and 16, graph and eager, with the bytes floors
#   dspark-pass (300)   benchmarks/dspark_pass.py: the DSpark drafter's pass on k3-tiny (bf16), torch steps vs the
#                       fused kernel, eager and graphed, batch 1/4/16/64 (op counts and the check first)
#   spec-bench (540)    k3rt bench spec on k3-tiny (bf16): code and agent, batch 1 and 16, dspark and suffix, graphs on
#   spec-gate (580)     benchmarks/spec_gate.py on k3-tiny (bf16): correctness (deterministic, the speculation
#                       controller on), then per batch 1/4/16/64 the controller (dspark: 8 device rounds) vs plain,
#                       code/chat/agent x ngram/suffix/dspark, 8 requests and 4 waves per row at least, 3 rounds
#                       (each drafter next to a plain run of its own; session 22's 2-round rows spread by up to 0.25),
#                       until --budget-s 480 (issue 16's 2.5x at batch 1 on code and >= 0.95x goals)
#   spec-rounds (150 + 420) the device-rounds GPU tests (tests/backend/test_spec_rounds.py), then the gate with the
#                       controller on and --spec-rounds 8 (dspark; code/agent; batch 1/16/64), whose rows carry the
#                       controller's plans by reason and its state (costs, acceptance, governor)
#   jit-churn (120 + 240) the compile-churn GPU test (tests/backend/test_jit_churn.py), then benchmarks/jit_churn.py
#                       on k3-tiny (bf16, graphs on): binaries compiled per kernel in a warm-up and in 40 varied
#                       prompts (1..300 tokens) arriving while others decode; 0 in the measured phase is the goal
#   tp-tests (300)      tensor parallelism in the GPU runner on 2 GPUs (gpu tests of test_tp_gpu_runner.py and
#                       test_tp_bench.py; they skip with fewer GPUs): ask for nvidia-h200-x2
#   tp (540)            k3rt bench tp: 48B shape, TP 1 and 2, batch 1/16/64 at 4K, the latent tail AR vs RS
#   tp-symm (540)       TP 2 alone with --symm-allreduce (the model's all-reduces through symmetric memory)
#   k3-slice (580)      benchmarks/k3_slice.py --tp 2: a K3-width slice (4 layers, 64 random MXFP4 experts, ~6 GB
#                       checkpoint written to /tmp) greedy under TP2 in bf16 against the fp32 CPU reference, 16 tokens
#                       (issue 17's end-to-end goal): ask for nvidia-h200-x2
#   profile (220)       benchmarks/decode.py: 48B decode 1/16/64 at 4K with the kernels of one eager step at batch 1 and
#                       16 by name, prefill 8K/32K with the kernels of each one's last chunk (session 24)
#   kda-probe (200)     benchmarks/kernels.py at 16K, no fla: the fused intra kernel with one stage skipped per probe
#                       (probe_*: where its time goes), and 4 / 16 warps against the default 8
#   tiny-linear (120)   benchmarks/kernels_linear.py --model k3-tiny: k3-tiny's projections at 1, 8 and 16 rows
#   prep (150)          benchmarks/kda_prep.py: the KDA conv/gate launch at the 48B layer, 8K and 32K rows, one
#                       sequence (indexed and one_seq tiles) and 8 / 64 sequences (natural row blocks read x directly)
#   spec-round (150)    benchmarks/spec_round.py: k3-tiny batch 1, plain and dspark with 8 device rounds: step time,
#                       each graph alone, the kernels of a round by name
# Outputs: $OUT/<stage>.log and, for benchmarks, $OUT/<stage>.json (at most 8 files come back from a call:
# choose at most 4 benchmark stages per call).
set -u
for stage in "$@"; do
  case $stage in
    tests|tests-runner|tests-kernels|decode|kda|mla|moe|linear|mxfp4|det|overlap|serve) ;;
    spec-tests|spec-verify|dspark-pass|spec-bench|spec-gate|spec-rounds|jit-churn|tp-tests|tp|tp-symm|k3-slice) ;;
    profile|kda-probe|tiny-linear|spec-round|prep|kda-blocks|k3-launches|kda-warps|spec-b1) ;;
    kda-multi|kda-fused-gc|kda-forms-48b|bf16-paths|spec-b16|kda-phases|kda-default|kda-decode-probe|kda-decode) ;;
    moe-layer|kda-layer|mla-gluon|decode-mla|kda-pdl|bw-probe|bw-kda|gemv-tests|gemv-forms|gemv-forms-h100) ;;
    *) echo "unknown stage: $stage (see the header of $0)" >&2; exit 2 ;;
  esac
done
OUT=${OUT:-./device_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-build-isolation --no-deps -e . >/dev/null 2>&1

run() {  # run <stage> <seconds> <command...>: output appended to $OUT/<stage>.log; to stdout a verdict
         # line, the failures and the benchmark's markdown tables
  local stage=$1 limit=$2
  shift 2
  local t0=$SECONDS before
  before=0
  [ -f "$OUT/$stage.log" ] && before=$(wc -l <"$OUT/$stage.log")
  echo "### $*" >>"$OUT/$stage.log"
  timeout "$limit" "$@" >>"$OUT/$stage.log" 2>&1
  local rc=$?
  # this run's own lines: its pytest verdict, or the benchmark's tables
  local new
  new=$(tail -n +"$((before + 1))" "$OUT/$stage.log")
  echo "[$stage] rc=$rc $((SECONDS - t0))s $(grep -E '[0-9]+ (passed|failed)' <<<"$new" | tail -1)"
  [ "$rc" = 124 ] && echo "[$stage] stopped at its ${limit}s limit"
  grep -E "FAILED|ERROR|^E |^\|" <<<"$new" | head -40
}

gpu_pytest() {  # gpu_pytest <stage> <seconds> <paths...>: -v, so each test's verdict is its own line
  local stage=$1 limit=$2
  shift 2
  # a module that cannot import here (a CPU-only test dependency such as jsonschema is absent on the device)
  # must not stop the GPU tests of the other modules
  run "$stage" "$limit" python3 -m pytest -o addopts="" -m gpu -v -p no:warnings --tb=short --continue-on-collection-errors "$@"
}

for stage in "$@"; do
  case $stage in
    tests-runner|tests)
      gpu_pytest tests-runner 540 tests/backend ;;&
    tests-kernels|tests)
      for pkg in kda mla moe linear norm attn_res sampling spec; do  # ~30 s each, most of it compiling
        gpu_pytest tests-kernels "$(case $pkg in kda) echo 200 ;; moe) echo 90 ;; *) echo 60 ;; esac)" \
          tests/kernels/test_"${pkg}"_*.py
      done ;;
    decode)
      run decode 200 python3 benchmarks/decode.py --batch 1 16 64 --profile 1 --prefill 8192 32768 \
        --prefill-configs kda_intra=fused --variants control moe_one_token no_sum_add_norm kda_norm_in_o_proj \
        moe_layer_one_token kda_layer_one_token mla_layer_one_token layers_one_token \
        --budget-s 180 \
        --out "$OUT/decode.json" ;;
    kda)
      run kda 240 python3 benchmarks/kernels.py --decode-n 1 16 --prefill 8192 16384 65536 8x4096 \
        --prefill-variants base blocks_intra --budget-s 220 --out "$OUT/kda.json" ;;
    kda-blocks)
      gpu_pytest kda-blocks 120 tests/kernels/test_kda_triton.py -k "chunk"
      run kda-blocks 200 python3 benchmarks/kernels.py --no-fla --decode-n --prefill 16384 --prefill-variants base \
        blocks_intra --prefill-sweep blocks_intra_w1 blocks_intra_w2 blocks_intra_w8 blocks_intra_sliced \
        blocks_intra_sliced_w2 blocks_intra_pairs blocks_intra_pairs_w2 blocks_intra_bk64 --sweep-case 16384 \
        --budget-s 180 --out "$OUT/kda_blocks.json" ;;
    kda-warps)
      run kda-warps 250 python3 benchmarks/kernels.py --decode-n 1 --prefill 16384 65536 8x4096 \
        --prefill-variants blocks_intra blocks_intra_w4 --budget-s 230 --out "$OUT/kda_warps.json" ;;
    kda-multi)
      run kda-multi 120 python3 -m pytest -o addopts="" -v -p no:warnings --tb=short tests/kernels/test_kda_multi.py
      run kda-multi 220 python3 benchmarks/kda_multi.py --budget-s 200 --out "$OUT/kda_multi.json"
      run kda-multi 180 python3 benchmarks/spec_verify.py --model k3-tiny --batch 1 16 --variants multi multi_hoist \
        --budget-s 160 --out "$OUT/kda_multi_verify.json" ;;
    kda-fused-gc)
      run kda-fused-gc 150 python3 -m pytest -o addopts="" -v -p no:warnings --tb=short \
        tests/kernels/test_kda_triton.py -k "kimi_shape or steep or inverse_regs or fused_gc or l_chunk or out_chunk"
      run kda-fused-gc 340 python3 benchmarks/kernels.py --decode-n --prefill 16384 65536 8x4096 \
        --prefill-variants blocks_intra blocks_intra_bk16 blocks_intra_fused_gc_bk16 blocks_intra_fused_gc_r168 \
        blocks_intra_fused_gc_r128 blocks_intra_fused_gc \
        blocks_intra_out_chunk blocks_intra_all_four blocks_intra_inverse_regs blocks_intra_l_chunk --budget-s 320 --out "$OUT/kda_fused_gc.json" ;;
    kda-phases)
      run kda-phases 330 python3 benchmarks/kernels.py --decode-n --prefill 16384 65536 8x4096 \
        --prefill-variants blocks_intra blocks_intra_old_default blocks_intra_out_chunk blocks_intra_out_chunk_s3 \
        blocks_intra_out_chunk_w8_bk64 blocks_intra_gc_sliced_w2 blocks_intra_gc_sliced_w4 \
        --prefill-sweep blocks_intra_inv_w2 blocks_intra_out_s3 blocks_intra_out_chunk_w8_s3 --sweep-case 65536 \
        --profile-kernels --budget-s 315 --out "$OUT/kda_phases.json"
      run kda-phases 90 python3 -m pytest -o addopts="" -v -p no:warnings --tb=short \
        tests/kernels/test_kda_triton.py -k "kimi_shape or per_phase or norms_in_l" ;;
    kda-default)
      run kda-default 200 python3 benchmarks/kernels.py --decode-n --prefill 8192 16384 65536 8x4096 \
        --prefill-variants blocks_intra blocks_intra_s36_default --budget-s 180 --out "$OUT/kda_default.json"
      run kda-default 150 python3 -m pytest -o addopts="" -v -p no:warnings --tb=short \
        tests/kernels/test_kda_triton.py -k "chunk_kimi_shape or out_chunk or norms_in_l or per_phase" ;;
    bw-probe)
      run bw-probe 150 python3 benchmarks/bandwidth_probe.py --budget-s 140 --out "$OUT/bandwidth_probe.json" ;;
    bw-kda)
      run bw-kda 220 python3 benchmarks/bandwidth_probe.py --kda-n 16 64 --mla 1x32768 --budget-s 210 \
        --out "$OUT/bandwidth_probe_kda.json" ;;
    gemv-tests)
      gpu_pytest gemv-tests 240 tests/backend/test_gpu_runner.py tests/kernels/test_moe_triton.py \
        tests/kernels/test_linear_triton.py -k "one_row_gemv or one_token_paths or prefetch or unrolled or gemv" ;;
    kda-pdl)
      gpu_pytest kda-pdl 120 tests/kernels/test_kda_triton.py tests/kernels/test_linear_triton.py \
        tests/backend/test_gpu_runner.py -k "pdl or trigger"
      run kda-pdl 110 python3 benchmarks/kernels.py --decode-sweep --decode-n 1 --prefill --budget-s 100 \
        --out "$OUT/kda_pdl.json" ;;
    kda-decode-probe)
      run kda-decode-probe 120 python3 benchmarks/kernels.py --decode-sweep --decode-n 1 --prefill --budget-s 110 \
        --out "$OUT/kda_decode_probe.json" ;;
    kda-layer)
      gpu_pytest kda-layer 150 tests/kernels/test_kda_layer.py tests/kernels/test_mla_layer.py
      run kda-layer 150 python3 benchmarks/kda_layer.py --budget-s 140 --out "$OUT/kda_layer.json"
      run kda-layer 100 python3 benchmarks/mla_layer.py --budget-s 90 --out "$OUT/mla_layer.json" ;;
    moe-layer)
      gpu_pytest moe-layer 150 tests/kernels/test_moe_layer.py
      run moe-layer 150 python3 benchmarks/kernels_moe.py --layer-only --budget-s 140 \
        --out "$OUT/kernels_moe_layer.json" ;;
    kda-decode)
      run kda-decode 200 python3 benchmarks/kernels.py --decode-n 1 2 4 8 16 32 64 --decode-norm --prefill \
        ${DECODE_BASELINE:+--decode-baseline "$DECODE_BASELINE"} --budget-s 190 --out "$OUT/kda_decode.json"
      run kda-decode 150 python3 benchmarks/kernels.py --decode-sweep --decode-n 16 64 --prefill --budget-s 140 \
        --out "$OUT/kda_decode_sweep.json" ;;
    kda-forms-48b)
      run kda-forms-48b 240 python3 benchmarks/decode.py --batch 1 --prefill 8192 32768 --variants \
        --prefill-configs kda_blocks_fuse_gc=1 kda_blocks_inverse_regs=1 kda_blocks_out_chunk=1 kda_blocks_l_chunk=1 \
        kda_blocks_fuse_gc=1,kda_blocks_inverse_regs=1,kda_blocks_out_chunk=1,kda_blocks_l_chunk=1 --budget-s 220 \
        --out "$OUT/kda_fused_gc_48b.json" ;;
    bf16-paths)
      gpu_pytest bf16-test 120 tests/backend/test_gpu_runner.py -k bf16_logits
      run bf16-paths 200 python3 benchmarks/bf16_paths.py --budget-s 180 --out "$OUT/bf16_paths.json" ;;
    spec-b16)
      run spec-b16 230 python3 benchmarks/spec_gate.py --device cuda --dtype bfloat16 --batch-sizes 16,64 \
        --workloads agent,code --drafters dspark --rounds 3 --no-check --no-always --budget-s 200 \
        --out "$OUT/spec_b16_gate.json" ;;
    spec-b1)
      run spec-b1 130 python3 benchmarks/spec_gate.py --device cuda --dtype bfloat16 --batch-sizes 1 \
        --workloads code,agent --drafters dspark --rounds 3 --no-check --no-always --budget-s 110 \
        --out "$OUT/spec_b1_gate.json"
      run spec-b1 110 python3 benchmarks/spec_round.py --device cuda --dtype bfloat16 --batch 1 \
        --engines plain,dspark:16 --profile-steps 4 --profile-prefill --top 40 --budget-s 100 \
        --out "$OUT/spec_b1_round.json" ;;
    mla)
      run mla 240 python3 benchmarks/kernels_mla.py --decode-only --budget-s 200 \
        ${MLA_BASELINE:+--decode-baseline "$MLA_BASELINE"} --out "$OUT/mla.json" ;;
    mla-gluon)
      gpu_pytest mla-gluon 90 tests/kernels/test_mla_gluon.py -k "tokens or n64x2_serial or odd or graph"
      run mla-gluon 100 python3 benchmarks/kernels_mla.py --decode-only --budget-s 90 --decode-variants \
        "default (h32 n32 w4 x3 2/SM)" "default two-step combine" "gluon n64 x2" "gluon tokens n64 x2" \
        "gluon tokens n64 x2 bf16 partials" --out "$OUT/mla_gluon.json" ;;
    decode-mla)
      run decode-mla 240 python3 benchmarks/decode.py --batch 1 16 64 --profile 1 --prefill --variants control \
        mla_triton mla_gluon kda_decode_pdl kda_decode_pdl_trigger kda_norm_in_o_proj mla_two_step_combine \
        layers_one_token \
        --budget-s 220 \
        --out "$OUT/decode_mla.json" ;;
    gemv-forms|gemv-forms-h100)
      run "$stage" 330 python3 benchmarks/decode.py --batch 1 $([ "$stage" = gemv-forms-h100 ] && echo --layers 12) \
        --variants control no_gemv_forms no_gemv_wide no_moe_gemv kda_decode_pdl_trigger \
        --graph-timeline 1 --graph-timeline-variants control kda_decode_pdl_trigger \
        --budget-s 300 --out "$OUT/$stage.json" ;;
    moe)
      run moe 200 python3 benchmarks/kernels_moe.py --decode-t 1 64 --prefill-t 2048 8192 32768 --budget-s 180 \
        --out "$OUT/moe.json" ;;
    mxfp4)
      gpu_pytest mxfp4 150 tests/kernels/test_moe_mxfp4.py
      run mxfp4 300 python3 benchmarks/kernels_mxfp4.py --budget-s 270 --out "$OUT/mxfp4.json" ;;
    det)
      gpu_pytest det 150 tests/backend/test_deterministic.py
      run det 120 python3 benchmarks/deterministic.py --device cuda --requests 64 --json "$OUT/det_tiny.json"
      run det 300 python3 benchmarks/deterministic.py --device cuda --preset kimi-linear-48b --vocab 8192 \
        --requests 64 --num-pages 512 --json "$OUT/det_48b.json" ;;
    serve)
      mkdir -p /tmp/serve_logs
      run serve 470 python3 benchmarks/serve_gpu.py --concurrency 1 64 --requests 512 --max-tokens 128 \
        --request-rate 16 --budget-s 400 --log-dir /tmp/serve_logs --out "$OUT/serve.json"
      tail -n 30 /tmp/serve_logs/*.log > "$OUT/serve_servers.log" 2>&1
      run serve 110 python3 benchmarks/decode.py --batch 64 --prefill --mixed 32 128 512 1792 --budget-s 90 \
        --out "$OUT/serve_decode.json" ;;
    spec-tests)
      gpu_pytest spec-tests 300 tests/backend/test_spec.py tests/backend/test_dspark_engine.py \
        tests/backend/test_spec_deterministic.py tests/backend/test_spec_rounds.py ;;
    spec-verify)
      run spec-verify 300 python3 benchmarks/spec_verify.py --batch 1 16 --budget-s 260 --out "$OUT/spec_verify.json" ;;
    dspark-pass)
      run dspark-pass 300 python3 benchmarks/dspark_pass.py --budget-s 260 --out "$OUT/dspark_pass.json" ;;
    spec-bench)
      run spec-bench 540 python3 -m k3rt.cli bench spec --device cuda --dtype bfloat16 --workloads code,agent \
        --batch-sizes 1,16 --drafters dspark,suffix --out "$OUT/spec_bench.json" ;;
    spec-gate)
      run spec-gate 580 python3 benchmarks/spec_gate.py --device cuda --dtype bfloat16 --budget-s 480 \
        --spec-rounds 8 --rounds 3 --no-always --out "$OUT/spec_gate.json" ;;
    spec-rounds)
      gpu_pytest spec-rounds 150 tests/backend/test_spec_rounds.py
      run spec-rounds 420 python3 benchmarks/spec_gate.py --device cuda --dtype bfloat16 --no-check --no-always \
        --rounds 2 --batch-sizes 1,16,64 --workloads code,agent --drafters dspark --spec-rounds 8 --budget-s 380 \
        --out "$OUT/spec_rounds_gate.json" ;;
    jit-churn)
      gpu_pytest jit-churn 120 tests/backend/test_jit_churn.py
      run jit-churn 240 python3 benchmarks/jit_churn.py --device cuda --out "$OUT/jit_churn.json" ;;
    tp-tests)
      gpu_pytest tp-tests 300 tests/backend/test_tp_gpu_runner.py tests/backend/test_tp_bench.py ;;
    tp)
      run tp 540 python3 -m k3rt.cli bench tp --tp 1 2 --batch 1 16 64 --context 4096 --out "$OUT/tp.json" ;;
    k3-slice)
      run k3-slice 580 python3 benchmarks/k3_slice.py --tp 2 --dir /tmp/k3_slice --out "$OUT/k3_slice.json" ;;
    tp-symm)
      run tp-symm 540 python3 -m k3rt.cli bench tp --tp 2 --batch 1 16 64 --context 4096 --symm-allreduce \
        --out "$OUT/tp_symm.json" ;;
    linear)
      run linear 100 python3 benchmarks/kernels_linear.py --budget-s 80 --out "$OUT/linear.json" ;;
    profile)
      run profile 220 python3 benchmarks/decode.py --batch 1 16 64 --profile 1 16 --prefill 8192 32768 \
        --profile-prefill --variants --budget-s 200 --out "$OUT/profile.json" ;;
    kda-probe)
      run kda-probe 200 python3 benchmarks/kernels.py --no-fla --decode-n --prefill 16384 --prefill-variants base \
        --prefill-sweep probe_no_blocks probe_no_subst probe_no_series probe_no_wu probe_no_cumsum probe_only_io \
        intra_w4 intra_w16 --sweep-case 16384 --budget-s 180 --out "$OUT/kda_probe.json" ;;
    prep)
      run prep 150 python3 benchmarks/kda_prep.py --tokens 8192 32768 --seqs 8 64 --budget-s 130 \
        --out "$OUT/prep.json" ;;
    tiny-linear)
      run tiny-linear 120 python3 benchmarks/kernels_linear.py --model k3-tiny --rows 1 8 16 --budget-s 110 \
        --out "$OUT/tiny_linear.json" ;;
    k3-launches)
      gpu_pytest k3-launches 200 tests/kernels/test_mla_triton.py tests/kernels/test_moe_triton.py \
        tests/kernels/test_moe_mxfp4.py tests/backend/test_gpu_runner.py tests/kernels/test_attn_res_triton.py \
        -k "gate or route or norm or k3 or latent or pair or shared"
      run k3-launches 90 python3 benchmarks/launches.py --device cuda --dtype bfloat16 --batch 1 4 --budget-s 80 \
        --out "$OUT/k3_launch_counts.json"
      run k3-launches 150 python3 benchmarks/decode.py --model k3-tiny --batch 1 4 16 --prefill \
        --variants control unfused no_latent_fusion no_fused_router no_pair_blocks stacked_mix pdl --budget-s 130 \
        --out "$OUT/k3_launches.json" ;;
    spec-round)
      run spec-round 150 python3 benchmarks/spec_round.py --device cuda --dtype bfloat16 --batch 1 \
        --engines plain,dspark:8 --profile-steps 4 --top 70 --budget-s 140 --out "$OUT/spec_round.json" ;;
    overlap)
      run overlap 480 python3 benchmarks/overlap.py --batch 64 256 --budget-s 420 --out "$OUT/overlap.json" ;;
    *) ;;  # tests-runner / tests-kernels after their own clause (;;& tests the later patterns too)
  esac
done
