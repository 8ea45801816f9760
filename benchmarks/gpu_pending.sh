#!/usr/bin/env bash
# The GPU measurements that issues 16 (generation) and 17 (training phase) still wait for, planned
# for one session's device time (30 minutes, machine starts included) as three device calls of
# under 10 minutes each, in order of need. Each command appends its tables to benchmarks/RESULTS.md
# and copies that file to $OUT at once, so a call stopped at its limit still returns what it measured.
#
#   here, once:        benchmarks/gpu_pending.sh wheels       (the packages the GPU image lacks, into .whl/)
#   on the GPU, each:  benchmarks/gpu_pending.sh PART         (run with kind nvidia-h200, carry [".whl"])
#
#   step      (~8 min) issues 16 and 17: vlmrl's whole step against TRL's on the 3B architecture:
#             generation (compiled decoding), training phase, MFU, peak memory (no new step after
#             450 s once one is measured: the table over fewer steps beats none at the call's limit);
#             then one more vlmrl step under torch.profiler into $OUT/profile_step.txt (the kernels)
#   decode    (~8 min) every test marked gpu (block attention, fused kernels, stochastic rounding,
#             the compiled decode step as a CUDA graph, the vision windows batched), then issue 16's decode table (each decode
#             path: ms per step, tokens/s, share of the bandwidth floor), then AdamW's step at 3B
#             size in bf16 (foreach, fused, RoundingAdamW: time, memory, update kept)
#   variants  (~9 min) issue 17's ablations, on one 3B folder built first: the packed pass, the
#             vision windows in a loop against batched, dense mask against blocks, and the model's
#             own RMSNorm/MLP against liger's fused kernels (values, gradients, time, memory,
#             attention calls); then vlmrl's step alone (--vlmrl-only, against `step`'s TRL column; eager
#             decoding, as only the training phase differs) with checkpointing off, with the fused
#             kernels, with the dense mask; last, the preflight's activation estimate against the
#             training pass's peak (bench_memory.py: packed and plain, checkpointing off and on)
#
# Use kind nvidia-h200: `step` holds both trainers' 3B models, references and optimizer states at
# once (about 75 GB before activations, over an H100's 80 GB), and the issues' figures were taken
# on an H200.
set -uo pipefail
cd "$(dirname "$0")/.."

WHEELS="transformers==5.24.0 tokenizers==0.23.3 trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2 rapidfuzz==3.14.6 fsspec==2026.9.0 liger-kernel==0.8.5"
SHAPE="--prompts 8 --group 8 --image 896 --tokens 256"
STEP="benchmarks/bench_vs_trl.py --arch-3b --device cuda --dtype bfloat16 $SHAPE --micro 16 --warmup 1 --steps 2"
PASS="benchmarks/bench_pass.py --arch-3b --device cuda --prompts 2 --group 8 --image 896 --tokens 256"
RESULTS=benchmarks/RESULTS.md
failed=0

measure() {  # run one command; keep RESULTS.md in $OUT whatever it did; go on to the next
    echo "+ $*"
    "$@" || { echo "FAILED ($?): $*"; failed=1; }
    cp "$RESULTS" "${OUT:-/tmp}/RESULTS.md"
}

part=${1:?"which part: wheels, step, decode or variants"}
if [[ $part == wheels ]]; then
    set -e
    exclude="$(git rev-parse --git-dir)/info/exclude"  # the wheels travel as a carried, ignored folder
    mkdir -p "$(dirname "$exclude")"
    grep -qsx '/.whl/' "$exclude" || echo '/.whl/' >> "$exclude"
    # shellcheck disable=SC2086
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl $WHEELS
    exit
fi
[[ $part =~ ^(step|decode|variants)$ ]] || { echo "unknown part: $part (wheels, step, decode, variants)" >&2; exit 2; }

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
# shellcheck disable=SC2086
case $part in
    step) measure python3 $STEP --time-budget 450 --results $RESULTS --profile "${OUT:-/tmp}/profile_step.txt" ;;
    decode) measure python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_block_attention.py \
                tests/test_fused_kernels.py tests/test_stochastic_rounding.py tests/test_decoding.py \
                tests/test_vision_attention.py
            measure python3 benchmarks/bench_decode.py --arch-3b --device cuda $SHAPE --warmup 1 --repeats 2 \
                --results $RESULTS
            measure python3 benchmarks/bench_optimizer.py --params 3.75e9 --dtype bfloat16 --device cuda \
                --results $RESULTS ;;
    variants) model=/tmp/qwen2.5-vl-3b-architecture  # built once for every command below
              measure python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from pathlib import Path
from bench_vs_trl import qwen25vl_3b_folder; qwen25vl_3b_folder(Path('$model'), 896)"
              for compare in vision attention fused; do
                  measure python3 ${PASS/--arch-3b/--model $model} --compare $compare --results $RESULTS
              done
              for variant in --no-checkpointing --fused-kernels --dense-attention; do
                  measure python3 ${STEP/--arch-3b/--model $model} --vlmrl-only --decode dynamic $variant \
                      --results $RESULTS
              done
              measure python3 benchmarks/bench_memory.py --model $model --device cuda --prompts 2 --group 8 \
                  --image 896 --tokens 256 --results $RESULTS ;;
esac
exit $failed
