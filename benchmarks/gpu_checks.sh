#!/usr/bin/env bash
# The GPU run of benchmarks/gpu_4bit.py, one part per command on a GPU machine. benchmarks/gpu_plan.py says what
# each part carries, its stages and each stage's time limit (`python benchmarks/gpu_4bit.py plan` prints it all):
#
#   bash benchmarks/gpu_checks.sh part1 OUT_DIR  # the 7B-shaped step (int4 / NF4 / bf16), then the CUDA tests
#   bash benchmarks/gpu_checks.sh part2 OUT_DIR  # the embedded GGUF joined and checked, its Hydra drafts on int4
#   bash benchmarks/gpu_checks.sh part3 OUT_DIR  # KL of int4/NF4, the EAGLE-3 and Medusa-1 drafts, the kernels,
#                                                # the summary (gpu_4bit_<card>_<date>.json)
#
# Stages:
#   step_4bit     gpu_4bit.py step7b: a 7B-shaped Llama loaded int4 / NF4 / bf16: plain tok/s, the 64-node step's
#                 cost, greedy identity, peak GPU memory of the int4 load
#   cuda_tests    the CUDA tests CI runs under Triton's interpreter, on the GPU (row invariance, the load check)
#   embedded_prepare  the GGUF's pieces joined and dequantized by this app's reader, hash-checked against the CPU's
#   embedded_<drafts>_<quant>  `medusa-chat bench` on CUDA with a shipped draft: acceptance, speedup, identity
#   fidelity_4bit teacher-forced KL of int4 (groups 64, 128) and NF4 against 16 bits
#   kernels_4bit  gpu_4bit.py kernels: Triton int4, tinygemm, gemlite, NF4, FP8, 16-bit, per row count
#   summary       gpu_4bit.py summary over every stage's JSON so far
# Each stage writes its JSON into OUT_DIR as it goes (a timeout loses the stage in flight only); the stages' output
# goes to OUT_DIR/PART.log and their exit statuses to OUT_DIR/PART_stages.txt (a few files: what a GPU machine
# returns may be limited in count). What later parts need (the GGUF's pieces, the unpacked wheels, the converted
# model, every JSON for the summary) is kept under GPU_WORK (default /tmp/gpu4bit) on the machine.
# Dry run on a CPU (tests/test_gpu_4bit_script.py): TRITON_INTERPRET=1 GPU_4BIT_ARGS="--tiny --device cpu"
#   GPU_DEVICE=cpu GPU_BENCH_ARGS="--limit 1 --max-new-tokens 4" bash benchmarks/gpu_checks.sh part1 /tmp/dry
# GPU_STAGES="a b" runs only the stages named; GPU_LIMIT_SCALE multiplies every limit (a dry run's). Needs torch,
# triton, transformers; bitsandbytes and gemlite where importable (.whl/site, benchmarks/gpu_prepare.sh). No
# network, no downloads.
set -uo pipefail
part="${1:?usage: gpu_checks.sh part1|part2|part3 OUT_DIR}"
out="${2:-gpu-checks}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
py="${PYTHON:-python3}"
cd "$(dirname "$0")/.."
work="${GPU_WORK:-/tmp/gpu4bit}"
mkdir -p "$work/json" "$work/g" "$work/site"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
export MEDUSA_CHAT_CACHE="${MEDUSA_CHAT_CACHE:-$work/cache}"
if [ -d .whl/site ]; then cp -r .whl/site/. "$work/site/"; fi
for piece in .gpu/p*; do if [ -d "$piece" ]; then cp -r "$piece"/. "$work/g/"; fi; done
export PYTHONPATH="$work/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
read -r -a extra <<<"${GPU_4BIT_ARGS:-}"  # e.g. "--tiny --device cpu" for a dry run
read -r -a bench <<<"${GPU_BENCH_ARGS:---limit 10 --max-new-tokens 64}"
device="${GPU_DEVICE:-cuda}"
log="$out/$part.log"
model="$work/embedded-fp32"

stage_cmd() {  # the command of one stage (its JSON goes straight into OUT_DIR)
    case "$1" in
    step_4bit) "$py" benchmarks/gpu_4bit.py step7b --out "$out/step7b.json" "${extra[@]}" ;;
    kernels_4bit) "$py" benchmarks/gpu_4bit.py kernels --out "$out/kernels.json" "${extra[@]}" ;;
    fidelity_4bit) "$py" benchmarks/gpu_4bit.py fidelity --model "$model" --out "$out/fidelity.json" "${extra[@]}" ;;
    cuda_tests) "$py" -m pytest -q -p no:cacheprovider -rs tests/test_cuda_int4.py tests/test_load_check.py \
        tests/test_graph_step.py tests/test_loading.py -k "int4 or path_attention or rows or cuda or recorded or check" ;;
    embedded_prepare) cat "$work"/g/g.* >"$work/embedded.gguf" && "$py" benchmarks/gpu_embedded_prepare.py \
        "$work/embedded.gguf" "$work/g/hf" "$work/g/hashes.json" "$model" ;;
    embedded_*_*)
        local run=${1#embedded_} heads q
        heads=${run%_*} q=${run##*_}
        "$py" -m medusa_chat bench --model "$model" --heads "assets/smollm2-135m$([ "$heads" = hydra ] || echo "-$heads")" \
            --device "$device" --quant "$q" --warmup 1 --quiet --prompts benchmarks/data/vicuna_bench_question.jsonl \
            "${bench[@]}" --baselines plain --json "$out/$1.json" ;;
    summary) "$py" benchmarks/gpu_4bit.py summary "$work/json" && cp "$work"/json/gpu_4bit_*.json "$out/" ;;
    *) echo "unknown stage $1"; return 2 ;;
    esac
}

{
    echo "== $part $(date -u +%FT%TZ)"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 | head -3
    "$py" -c "import torch, transformers, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__, 'triton', triton.__version__)" 2>&1 | tail -1
} >>"$log"
stages=$("$py" benchmarks/gpu_4bit.py plan --part "$part" --stages) || { echo "no plan for $part" | tee -a "$log"; exit 2; }
while read -r name secs; do
    if [ -n "${GPU_STAGES:-}" ] && [[ " $GPU_STAGES " != *" $name "* ]]; then continue; fi
    secs=$((secs * ${GPU_LIMIT_SCALE:-1}))  # a dry run under Triton's interpreter is slower than the GPU
    echo "== $name (limit ${secs}s)" | tee -a "$log"
    t0=$SECONDS
    timeout -k 5 "$secs" bash -c "$(declare -f stage_cmd); $(declare -p py out work extra bench device model); \
        stage_cmd $name" >>"$log" 2>&1
    rc=$?
    echo "== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$log"
    echo "$name $rc $((SECONDS - t0))" >>"$out/${part}_stages.txt"
    cp "$out"/*.json "$work/json/" 2>/dev/null  # what the summary of a later part reads
done <<<"$stages"
cat "$out/${part}_stages.txt"
