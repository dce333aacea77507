#!/usr/bin/env bash
# The GPU checks CI cannot run, as one prepared script in two parts (two calls on one warm machine).
#
#   bash benchmarks/gpu_checks.sh OUT_DIR                         # part 1: CUDA tests, kernels, 7B-shaped step
#   GPU_EMBEDDED="GGUF HF_FILES HASHES" bash benchmarks/gpu_checks.sh OUT_DIR   # part 2: the embedded model
#
# Part 1 (about 4 minutes on an H200):
#   cuda_tests    the CUDA tests CI skips or runs under Triton's interpreter: the int4 kernels and path attention
#                 on the GPU (row invariance there is what makes tree steps exact), the graph step, the loaders
#   kernels_4bit  benchmarks/gpu_4bit.py kernels: Triton int4, tinygemm, gemlite, NF4, FP8, 16-bit, per row count
#   step_4bit     benchmarks/gpu_4bit.py step7b: a 7B-shaped Llama loaded int4 / NF4 / bf16: plain tok/s, the
#                 64-node step's cost, greedy identity, peak GPU memory of the int4 load
# Part 2 (about 3 minutes; the GGUF staged by benchmarks/gpu_stage_gguf.sh, joined first):
#   embedded_prepare  the embedded model's GGUF dequantized by this app's reader, hash-checked against the CPU's
#   fidelity_4bit     gpu_4bit.py fidelity: teacher-forced KL of int4 (groups 64, 128) and NF4 vs 16 bits
#   embedded_<drafts>_<quant>  `medusa-chat bench` on CUDA with the shipped drafts, 10 Vicuna-bench prompts:
#                     real acceptance, speedup over the plain loop, identity with it
#   summary       gpu_4bit.py summary: OUT_DIR/gpu_4bit_<card>_<date>.json, the figures README may quote
# Dry run on a CPU (the plumbing, with tiny shapes under Triton's interpreter):
#   TRITON_INTERPRET=1 GPU_4BIT_ARGS="--tiny --device cpu" GPU_DEVICE=cpu bash benchmarks/gpu_checks.sh /tmp/dry
# GPU_STAGES="a b" runs only the stages named. Each stage has a time limit (seconds: GPU_<STAGE>_S) and a failed
# stage does not stop the next; every stage's log and JSON land in OUT_DIR.
# Needs: torch with CUDA, triton, transformers; bitsandbytes and gemlite where importable (PYTHONPATH may point at
# a folder of unpacked wheels: benchmarks/gpu_prepare.sh). No network, no downloads.
set -uo pipefail
out="${1:-gpu-checks}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
py="${PYTHON:-python}"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
export MEDUSA_CHAT_CACHE="${MEDUSA_CHAT_CACHE:-$out/cache}"
read -r -a extra <<<"${GPU_4BIT_ARGS:-}"  # e.g. "--tiny --device cpu" for a dry run
device="${GPU_DEVICE:-cuda}"

stage() {  # stage NAME SECONDS CMD...: run with a time limit, log to OUT_DIR/NAME.log, report the exit status
    local name=$1 secs=$2; shift 2
    if [ -n "${GPU_STAGES:-}" ] && [[ " $GPU_STAGES " != *" $name "* ]]; then
        echo "== $name skipped (not in GPU_STAGES)"; return
    fi
    echo "== $name (limit ${secs}s)"
    local t0=$SECONDS
    timeout "$secs" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    tail -15 "$out/$name.log"
    echo "== $name: exit $rc after $((SECONDS - t0)) s"
    echo "$name $rc $((SECONDS - t0))" >>"$out/stages.txt"
}

if [ -z "${GPU_EMBEDDED:-}" ]; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 | tee "$out/gpu.txt"
    "$py" -c "import torch, transformers, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__, 'triton', triton.__version__)" 2>&1 | tee -a "$out/gpu.txt"
    for pkg in bitsandbytes gemlite; do
        "$py" -c "import $pkg as p; print('$pkg', getattr(p, '__version__', '?'))" 2>&1 | tail -1 | tee -a "$out/gpu.txt"
    done
    stage cuda_tests "${GPU_TESTS_S:-150}" "$py" -m pytest -q -p no:cacheprovider -rs tests/test_cuda_int4.py \
        tests/test_graph_step.py tests/test_loading.py -k "int4 or path_attention or rows or cuda or recorded"
    stage kernels_4bit "${GPU_KERNELS_S:-150}" "$py" benchmarks/gpu_4bit.py kernels --out "$out/kernels.json" \
        "${extra[@]}"
    stage step_4bit "${GPU_STEP_S:-300}" "$py" benchmarks/gpu_4bit.py step7b --out "$out/step7b.json" \
        "${extra[@]}"
else
    read -r e_gguf e_hf e_hashes <<<"$GPU_EMBEDDED"
    e_model="${TMPDIR:-/tmp}/embedded-fp32"
    stage embedded_prepare "${GPU_PREP_S:-90}" "$py" -c "
import json, sys
from pathlib import Path
sys.path.insert(0, 'benchmarks')
from gpu_train_heads import prepare_model, tensor_hashes
from safetensors.torch import load_file
work = Path('${TMPDIR:-/tmp}/embedded-work'); work.mkdir(exist_ok=True)
folder = prepare_model('$e_gguf', work, '$e_hf', print)
want = json.loads(Path('$e_hashes').read_text())
got = tensor_hashes({k: v for k, v in load_file(str(folder / 'model.safetensors')).items() if k in want})
bad = [k for k in want if got.get(k) != want[k]]
print('weights vs the CPU conversion:', 'identical' if not bad else f'{len(bad)} tensors differ')
Path('$e_model').unlink(missing_ok=True); Path('$e_model').symlink_to(folder.resolve())
sys.exit(1 if bad else 0)"
    stage fidelity_4bit "${GPU_FID_S:-90}" "$py" benchmarks/gpu_4bit.py fidelity --model "$e_model" \
        --out "$out/fidelity.json" "${extra[@]}"
    for run in ${GPU_EMBEDDED_RUNS:-hydra:int4 eagle3:int4 medusa-1:int4 hydra:nf4}; do
        heads=${run%%:*} q=${run##*:}
        folder=assets/smollm2-135m$([ "$heads" = hydra ] || echo "-${heads//-/}")
        stage "embedded_${heads}_$q" "${GPU_EMB_S:-100}" "$py" -m medusa_chat bench --model "$e_model" \
            --heads "$folder" --device "$device" --quant "$q" --warmup 1 --quiet \
            --prompts benchmarks/data/vicuna_bench_question.jsonl --limit 10 --max-new-tokens 64 --baselines plain \
            --json "$out/embedded_${heads}_$q.json"
    done
    stage summary 30 "$py" benchmarks/gpu_4bit.py summary "$out"
fi
cat "$out/stages.txt"
# one archive of the logs and JSON files (not the cache), for machines that return only a few files
tar czf "$out.tgz" -C "$(dirname "$out")" --exclude=cache "$(basename "$out")" && echo "archive: $out.tgz"
