#!/usr/bin/env bash
# The runner behind benchmarks/README.md's tables: each step runs one table's script with the
# arguments its row cites, its anchor (transformers, llama.cpp, an older commit) in the same
# script or the same run, so the figures of one run can be compared. Logs go to $OUT (default
# /tmp/quire_bench/<date>-<commit>); each step prints its log, whose figures are the record.
#
#     bash benchmarks/run_all.sh                       # the CPU set most tables come from
#     STEPS="serve spec_decode" bash benchmarks/run_all.sh
#     STEPS=all bash benchmarks/run_all.sh             # every CPU table (an hour or more)
#     QUICK=1 STEPS=all bash benchmarks/run_all.sh     # smoke: tiny settings, figures meaningless
#     DRY_RUN=1 STEPS=all bash benchmarks/run_all.sh   # print the commands only
#     BASELINE=272f8b8 STEPS=baseline bash benchmarks/run_all.sh  # this engine against an older one
#
# From the repository root. llama.cpp (llama-bench, llama-server) is the CPU anchor: build it
# once with `bash benchmarks/build_llamacpp.sh` (into /tmp/llamabuild); without it the steps
# that need it say so and go on. GPU figures come from benchmarks/cuda_check.sh.
# Run nothing else on the machine meanwhile: the scripts print the CPU time stolen while they
# ran, and a run with steal, or on a loaded host, is not comparable with another.
set -u
py=${PYTHON:-.venv/bin/python}
[ -x "$py" ] || py=python3
export PYTHONPATH="$PWD/runtime${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
out=${OUT:-/tmp/quire_bench/$(date -u +%Y%m%d-%H%M)-$commit}
quick=${QUICK:-0}
dry=${DRY_RUN:-0}
DEFAULT_STEPS="throughput_f32 throughput_bf16 llamacpp prefix_cache memory"
ALL_STEPS="$DEFAULT_STEPS single_stream decode_profile prefix_cache_bound block_hashing
    capacity fp8_kv quant_parity int8_activations llamacpp_int8 quant_kernels quant_matmul quantized_memory
    soak serve spec_decode router structured grammar_backends tensor_parallel lora moe
    step_cost kv_tiering embeddings embeddings_512 priority pipeline_parallel vision
    prefill_roofline prefill_attention small_m cold_start worker_start"

args_for() {  # name -> the script and its arguments (QUICK=1: tiny settings)
    local q=$quick
    case $1 in
    throughput_f32)   echo throughput.py --hf-dtypes float32 --quiet $([ "$q" = 1 ] && echo --quick) ;;
    throughput_bf16)  if [ "$q" = 1 ]; then echo throughput.py --hf-dtypes bfloat16 --quick --quiet
                      else echo throughput.py --hf-dtypes bfloat16 --hf-batch-sizes 32 --hf-limit 16 --quiet; fi ;;
    llamacpp)         echo llamacpp_compare.py --rounds $([ "$q" = 1 ] && echo 1 || echo 5) ;;
    prefix_cache)     echo prefix_cache.py $([ "$q" = 1 ] && echo --num-requests 4 --prefix-len 128 --question-len 16 --max-tokens 4) ;;
    memory)           echo memory.py $([ "$q" = 1 ] && echo --quick) ;;
    single_stream)    echo single_stream.py --quantization none $([ "$q" = 1 ] && echo --quick) ;;
    decode_profile)   if [ "$q" = 1 ]; then echo decode_profile.py --cases fp32-1 --steps 4 --no-profile
                      else echo decode_profile.py --cases bf16-1,bf16-32 --steps 48; fi ;;
    prefix_cache_bound) echo prefix_cache_bound.py ;;
    block_hashing)    if [ "$q" = 1 ]; then echo block_hashing.py --rounds 1 --hash-tokens 4096 --skip-engine
                      else echo block_hashing.py --rounds 4; fi ;;
    capacity)         echo capacity.py $([ "$q" = 1 ] && echo --num-requests 50) ;;
    fp8_kv)           echo fp8_kv.py --num-prompts $([ "$q" = 1 ] && echo 2 --max-tokens 8 || echo 32 --max-tokens 64) ;;
    quant_parity)     echo quant_parity.py --num-prompts $([ "$q" = 1 ] && echo 2 --max-tokens 8 || echo 16 --max-tokens 32) ;;
    int8_activations) if [ "$q" = 1 ]; then echo quant_parity.py --quantizations auto --activation-quantization int8 --num-prompts 2 --max-tokens 8
                      else echo quant_parity.py --quantizations auto --activation-quantization none int8 --num-prompts 16 --max-tokens 32; fi ;;
    llamacpp_int8)    echo llamacpp_compare.py --with-int8-activations --rounds $([ "$q" = 1 ] && echo 1 || echo 5) ;;
    quant_kernels)    echo quant_kernels.py --m $([ "$q" = 1 ] && echo 1 || echo 1 8 32 512) ;;
    quant_matmul)     echo quant_matmul.py $([ "$q" = 1 ] && echo --m 1 --trials 3) ;;
    quantized_memory) echo quantized_memory.py $([ "$q" = 1 ] && echo --size small) ;;
    soak)             echo soak.py $([ "$q" = 1 ] && echo --requests 20 --concurrency 2 || echo --requests 200 --concurrency 8) ;;
    serve)            if [ "$q" = 1 ]; then echo serve.py --concurrency 1 --num-prompts 2 --skip-llama
                      else echo serve.py --plot; fi ;;
    spec_decode)      if [ "$q" = 1 ]; then echo spec_decode.py --quick
                      else echo spec_decode.py --rounds 5 --max-tokens 192 --plot; fi ;;
    router)           echo router.py $([ "$q" = 1 ] && echo --users 8 --turns 3 --max-tokens 8) ;;
    structured)       echo structured.py $([ "$q" = 1 ] && echo --max-tokens 8 --batch-sizes 1 4) ;;
    grammar_backends) echo grammar_backends.py ;;
    tensor_parallel)  echo tensor_parallel.py $([ "$q" = 1 ] && echo --num-requests 2 --output-len 4) ;;
    lora)             echo lora.py $([ "$q" = 1 ] && echo --num-requests 4 --output-len 4) ;;
    moe)              echo moe.py --num-threads 2 $([ "$q" = 1 ] && echo --quick) ;;
    baseline)         echo throughput.py --skip-hf --quiet $([ "$q" = 1 ] && echo --quick) ;;
    step_cost)        echo decode_profile.py --baseline ${STEP_BASELINE:-e189fa3} --cases fp32-1,fp32-32 \
                          $([ "$q" = 1 ] && echo --rounds 1 --max-tokens 16 || echo --rounds 5) ;;
    kv_tiering)       echo kv_tiering.py $([ "$q" = 1 ] && echo --quick || echo --plot) ;;
    embeddings)       echo embeddings.py $([ "$q" = 1 ] && echo --num-texts 32 || echo --plot) ;;
    embeddings_512)   echo embeddings.py --hidden-size 512 --num-layers 24 $([ "$q" = 1 ] && echo --num-texts 32) ;;
    priority)         if [ "$q" = 1 ]; then echo priority.py --batch 4 --interactive 2 --batch-tokens 8
                      else echo priority.py --plot; fi ;;
    pipeline_parallel) echo pipeline_parallel.py $([ "$q" = 1 ] && echo --num-requests 2 --input-len 32 --output-len 4 || echo --plot) ;;
    prefill_roofline) echo prefill_roofline.py $([ "$q" = 1 ] && echo --prompt-len 32 --formats gguf || echo --plot) ;;
    prefill_attention) echo prefill_attention.py $([ "$q" = 1 ] && echo --fresh 64 --extend 16 --context 256 --rounds 1 || echo --plot) ;;
    worker_start)     echo worker_start.py $([ "$q" = 1 ] && echo --rounds 1 --engines 2 || echo --plot) ;;
    small_m)          echo small_m.py $([ "$q" = 1 ] && echo --m 1 9 --trials 1 || echo --plot) ;;
    cold_start)       echo cold_start.py $([ "$q" = 1 ] && echo --rounds 1 || echo --rounds 3 --plot) ;;
    vision)           echo vision.py $([ "$q" = 1 ] && echo --quick --num-requests 4 --output-len 4 || echo --plot) ;;
    *)                return 1 ;;
    esac
}

run() {  # name, PYTHONPATH for the engine, script + arguments
    local name=$1 path=$2 start=$SECONDS rc
    shift 2
    if [ "$dry" = 1 ]; then
        echo "$name: python benchmarks/$*$([ "$path" = "$PYTHONPATH" ] || echo "  (engine: $path)")"
        return 0
    fi
    echo "=== $name: python benchmarks/$* ($(date -u +%H:%M:%S))"
    PYTHONPATH="$path" $py benchmarks/"$@" 2>&1 | tee "$out/$name.log"
    rc=${PIPESTATUS[0]}
    echo "=== $name: rc=$rc in $((SECONDS - start)) s"
}

steps=${STEPS:-$DEFAULT_STEPS}
[ "$steps" = all ] && steps=$ALL_STEPS
if [ "$dry" != 1 ]; then
    mkdir -p "$out"
    echo "quire benchmarks at $commit, $(date -u '+%Y-%m-%d %H:%M:%S') UTC; logs in $out"
    $py -c "import platform, torch; print(platform.node(), '| torch', torch.__version__,
'| threads', torch.get_num_threads())"
    grep -m1 "model name" /proc/cpuinfo 2>/dev/null
fi
for name in $steps; do
    cmd=$(args_for "$name") || { echo "unknown step: $name (steps: $ALL_STEPS baseline)" >&2; exit 2; }
    if [ "$name" = baseline ]; then
        # an older engine from a `git archive` snapshot, under this commit's scripts; the two
        # take turns, twice, so that a drift of the host shows as a spread, not as a ratio
        [ -n "${BASELINE:-}" ] || { echo "baseline: set BASELINE=<commit>" >&2; exit 2; }
        snap=$out/snapshot-$BASELINE
        if [ "$dry" != 1 ] && [ ! -d "$snap/runtime" ]; then
            mkdir -p "$snap" && git archive "$BASELINE" runtime | tar -x -C "$snap"
        fi
        for round in 1 2; do
            run "baseline_${commit}_$round" "$PWD/runtime" $cmd
            run "baseline_${BASELINE}_$round" "$snap/runtime" $cmd
        done
        continue
    fi
    run "$name" "$PYTHONPATH" $cmd
done
[ "$dry" = 1 ] || echo "done at $(date -u '+%H:%M:%S') UTC; logs in $out"
