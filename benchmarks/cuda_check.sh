#!/usr/bin/env bash
# What only a CUDA GPU shows, in one run sized for a short GPU lease (about 6 minutes on an
# H100/H200, plus a minute to start): the Triton kernel suites compiled on the GPU (the same
# cases CI runs in the interpreter), the engine's greedy parity with transformers and its throughput with CUDA
# graphs, eagerly and quantized, and the kernel timings. Each step has its own time limit, so
# one that hangs costs only its own slot. Logs go to $OUT (or /tmp/cuda_check).
#
#     bash benchmarks/cuda_check.sh            # from the repository root; python3 holds torch
#
# The GPU image has no llguidance: put its wheel (manylinux, abi3) in .whl/ and carry that
# folder; this script installs what is there.
set -u
out=${OUT:-/tmp/cuda_check}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONPATH="$PWD/runtime${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# packages the GPU image lacks (llguidance: the engine imports it) travel as wheels in .whl/
# (benchmarks/README.md, "Triton on a GPU"); nothing can be downloaded there
if ls .whl/*.whl >/dev/null 2>&1 && ! $py -c "import llguidance" 2>/dev/null; then
    $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/cuda_check_site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/cuda_check_site"
fi

step() {  # name, time limit (s), command...
    local name=$1 limit=$2 start=$SECONDS rc
    shift 2
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    rc=$?
    echo "=== $name: rc=$rc in $((SECONDS - start)) s (limit $limit s)"
    grep -E "${SHOW:-^(PARITY|QUIRE|HF|device|workload)|passed|failed|error|Error}" \
        "$out/$name.log" | tail -n 40
}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
$py -c "import torch, triton, transformers; print('torch', torch.__version__, '| triton',
triton.__version__, '| transformers', transformers.__version__)"

# STEPS picks and orders them; STEP_LIMIT_<name> overrides a step's time limit (s)
for name in ${STEPS:-triton_suites engine engine_1b quant_matmul attention}; do
    limit_var=STEP_LIMIT_$name
    case $name in
    triton_suites)
        QUIRE_TRITON_DEVICE=cuda step triton_suites "${!limit_var:-120}" $py -m pytest -q -n 8 \
            -p no:cacheprovider tests/runtime/triton_interpreter_suite.py \
            tests/quant/triton_quant_suite.py tests/lora/triton_interpreter_suite.py \
            -k "not engine_with_triton_gives_the_torch_paths_tokens" ;;
    engine)
        step engine "${!limit_var:-170}" $py benchmarks/cuda_engine.py ${ENGINE_ARGS:-} ;;
    engine_1b)
        step engine_1b "${!limit_var:-150}" $py benchmarks/cuda_engine.py --shape llama-1b \
            --skip-parity --hf-batch-sizes 64 128 ;;
    workload32)  # benchmarks/throughput.py's 32-request workload on the GPU, beside transformers
        model=/tmp/cuda_check_smollm2
        [ -e $model/config.json ] || $py benchmarks/cuda_engine.py --save-model $model >/dev/null
        SHOW="^(device|quire|transformers|best|32 requests)" step workload32 \
            "${!limit_var:-200}" $py benchmarks/throughput.py --device cuda --model $model \
            --quiet
        for q in int8 int4; do
            SHOW="^quire" step workload32_$q "${!limit_var:-60}" $py benchmarks/throughput.py \
                --device cuda --model $model --quiet --skip-hf --quantization $q
        done ;;
    quant_matmul)
        SHOW=. step quant_matmul "${!limit_var:-180}" $py benchmarks/cuda_quant_matmul.py \
            ${QUANT_ARGS:-} ;;
    attention)
        SHOW=. step attention "${!limit_var:-60}" $py benchmarks/attention_kernels.py \
            --batches 1 16 64 256 --contexts 512 2048 8192 --chunks 512 2048 ;;
    *)
        echo "unknown step $name" ;;
    esac
done
