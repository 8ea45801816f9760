#!/usr/bin/env bash
# The GPU measurements that issues 16 (generation) and 17 (training phase) still wait for, as device
# calls of under 10 minutes each (the device tool's limit). Each part appends its tables to
# benchmarks/RESULTS.md and copies that file to $OUT, so the figures come back with the call.
#
#   here, once:        benchmarks/gpu_pending.sh wheels        (the packages the GPU image lacks, into .whl/)
#   on the GPU, each:  benchmarks/gpu_pending.sh PART   (carry: [".whl"]), in this order of need:
#
#   decode      issue 16: each decode path of the 3B architecture, 8 prompts x G=8, 256 tokens (~5 min)
#   step        issues 16 and 17: a whole step against TRL (blocks, checkpointing on as before; ~7 min)
#   attention   issue 17: the block-attention tests marked gpu, then the packed pass, dense mask
#               against blocks (values, gradients, time, memory)
#   step-nockpt issue 17: the step with both sides' checkpointing off (~7 min)
#   step-dense  issue 17: the step with vlmrl's packed passes under the dense mask: control (~7 min)
#   fused       issue 17: the fused-kernel and stochastic-rounding tests marked gpu, then the packed
#               pass, the model's own RMSNorm and MLP against liger's fused kernels (values,
#               gradients, time, memory), then AdamW's step at 3B size in bf16: foreach, fused and
#               RoundingAdamW (time, memory, update kept)
#   step-fused  issue 17: the step with train.fused_kernels=true (~7 min)
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS="transformers==5.23.0 tokenizers==0.23.3 trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2 rapidfuzz==3.14.6 fsspec==2026.9.0 liger-kernel==0.8.5"
SHAPE="--prompts 8 --group 8 --image 896 --tokens 256"
STEP="benchmarks/bench_vs_trl.py --arch-3b --device cuda --dtype bfloat16 $SHAPE --micro 16 --warmup 1 --steps 3"

part=${1:?"which part: wheels, decode, step, attention, step-nockpt, step-dense, fused or step-fused"}
if [[ $part == wheels ]]; then
    exclude="$(git rev-parse --git-dir)/info/exclude"  # the wheels travel as a carried, ignored folder
    mkdir -p "$(dirname "$exclude")"
    grep -qsx '/.whl/' "$exclude" || echo '/.whl/' >> "$exclude"
    # shellcheck disable=SC2086
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl $WHEELS
    exit
fi

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
case $part in
    decode) python3 benchmarks/bench_decode.py --arch-3b --device cuda $SHAPE --warmup 1 --repeats 2 \
                --results benchmarks/RESULTS.md ;;
    step) python3 $STEP --results benchmarks/RESULTS.md ;;
    step-nockpt) python3 $STEP --no-checkpointing --results benchmarks/RESULTS.md ;;
    step-dense) python3 $STEP --dense-attention --results benchmarks/RESULTS.md ;;
    attention) python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_block_attention.py
               python3 benchmarks/bench_pass.py --arch-3b --device cuda --prompts 2 --group 8 --image 896 \
                   --tokens 256 --results benchmarks/RESULTS.md ;;
    step-fused) python3 $STEP --fused-kernels --results benchmarks/RESULTS.md ;;
    fused) python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fused_kernels.py tests/test_stochastic_rounding.py
           python3 benchmarks/bench_pass.py --compare fused --arch-3b --device cuda --prompts 2 --group 8 \
               --image 896 --tokens 256 --results benchmarks/RESULTS.md
           python3 benchmarks/bench_optimizer.py --params 3.75e9 --dtype bfloat16 --device cuda \
               --results benchmarks/RESULTS.md ;;
    *) echo "unknown part: $part (wheels, decode, step, attention, step-nockpt, step-dense, fused, step-fused)" >&2
       exit 2 ;;
esac
cp benchmarks/RESULTS.md "${OUT:-/tmp}/RESULTS.md"
