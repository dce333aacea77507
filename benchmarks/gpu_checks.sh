#!/usr/bin/env bash
# The GPU checks this repo cannot run in CI, as one prepared script (about 4 minutes on one H200 with the
# end-to-end stage at 1.17B; 7 with the 7B shape too).
#
#   bash benchmarks/gpu_checks.sh OUT_DIR
# On a GPU machine without network, prepare its packages and tokenizer first (benchmarks/gpu_prepare.sh), carry
# .whl and run `export PYTHONPATH=$PWD/.whl/site:$PWD PYTHON=python3; bash benchmarks/gpu_checks.sh /tmp/gc;
# tar czf $OUT/gpu_checks.tgz -C /tmp gc` (the device tool returns at most 8 files).
#
# 1. The CUDA tests CI skips: `load_model` on CUDA, NF4 through bitsandbytes, the lean forward in fp16, and the
#    verification step recorded as CUDA graphs (tests/test_graph_step.py: replies equal to the eager engine's).
# 2. Step latency of the 7B-shaped Llama three ways, same script, same process settings: the lean forward
#    replayed as CUDA graphs (the default on a GPU) plus greedy losslessness of the default path in fp16 and NF4
#    (against HF generate and the engine's own plain loop), the eager lean forward (MEDUSA_CHAT_COMPILE=0) and
#    the transformers forward (MEDUSA_CHAT_LEAN=0).
# 3. End to end (when a tokenizer folder is there: benchmarks/gpu_prepare.sh puts one in .whl/tokenizer): a
#    random-weight 1.17B Llama with 4 Medusa-1 heads written to disk, then `medusa-chat bench` on CUDA in NF4 and in
#    fp16 (load_model, the first-start calibration, the engine with graphs) against HF generate and the plain loop.
#    Random weights: the speeds and the identity count, not acceptance.
# 4. (with GPU_EMBEDDED) the embedded model's real weights on the GPU: see below.
# GPU_STAGES="cuda_tests make_1b bench_1b_nf4 bench_1b_none" runs only the stages named (default: all);
# GPU_E2E_SHAPES="1b 7b" adds the end-to-end stages at the 7B shape.
# Each stage has its own time limit and a failed stage does not stop the next (the whole run fits a 10-minute
# lease call); every stage's log and JSON land in OUT_DIR.
# Needs: torch with CUDA, transformers, bitsandbytes (the repo's requirements); no network, no downloads.
set -uo pipefail
out="${1:-gpu-checks}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
py="${PYTHON:-python}"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1

stage() {  # stage NAME SECONDS CMD...: run with a time limit, log to OUT_DIR/NAME.log, report the exit status
    local name=$1 secs=$2; shift 2
    if [ -n "${GPU_STAGES:-}" ] && [[ " $GPU_STAGES " != *" $name "* ]]; then
        echo "== $name skipped (not in GPU_STAGES)"; return
    fi
    echo "== $name (limit ${secs}s)"
    local t0=$SECONDS
    timeout "$secs" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    tail -25 "$out/$name.log"
    echo "== $name: exit $rc after $((SECONDS - t0)) s"
    echo "$name $rc $((SECONDS - t0))" >>"$out/stages.txt"
}

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 | tee "$out/gpu.txt"
"$py" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__)" 2>&1 | tee -a "$out/gpu.txt"
"$py" -c "import bitsandbytes as b; print('bitsandbytes', b.__version__)" 2>&1 | tail -1 | tee -a "$out/gpu.txt"

stage cuda_tests "${GPU_TESTS_S:-150}" "$py" -m pytest -q -p no:cacheprovider -rs tests/test_loading.py \
    tests/test_lean_forward.py tests/test_graph_step.py tests/test_calibrate.py -k "cuda or recorded"
stage step_latency_lean "${GPU_LEAN_S:-200}" "$py" benchmarks/gpu_step_latency.py --reps 10 --check-lossless \
    --out "$out/step_latency_lean.json"
MEDUSA_CHAT_COMPILE=0 stage step_latency_eager "${GPU_EAGER_S:-100}" "$py" benchmarks/gpu_step_latency.py \
    --reps 10 --out "$out/step_latency_eager.json"
MEDUSA_CHAT_LEAN=0 stage step_latency_transformers "${GPU_HF_S:-100}" "$py" benchmarks/gpu_step_latency.py \
    --reps 10 --out "$out/step_latency_transformers.json"
tokenizer="${E2E_TOKENIZER:-.whl/tokenizer}"
if [ -f "$tokenizer/tokenizer.json" ]; then
    for shape in ${GPU_E2E_SHAPES:-1b}; do  # "1b 7b" adds the 7B shape (13.5 GB written, 5 heads)
        models=$(mktemp -d)
        MAKE_MODELS_THREADS=8 stage "make_$shape" "${GPU_MAKE_S:-150}" "$py" benchmarks/make_real_size_models.py \
            "$shape" --out "$models" --tokenizer "$tokenizer"
        for q in nf4 none; do  # the first start calibrates the tree on the GPU (tuning/calibrate.py), then bench
            MEDUSA_CHAT_CACHE="$models/cache" stage "bench_${shape}_$q" "${GPU_BENCH_S:-150}" "$py" -m medusa_chat \
                bench --model "$models/hf" --heads "$models/medusa1" --device cuda --quant "$q" --warmup 1 --quiet \
                --prompts benchmarks/data/heldout_prompts.jsonl --limit 4 --max-new-tokens 64 --baselines hf,plain \
                --json "$out/bench_${shape}_$q.json"
        done
        rm -rf "$models"
    done
else
    echo "== end to end skipped: no $tokenizer/tokenizer.json (run benchmarks/gpu_prepare.sh first)"
fi
# 4. The embedded model with its real weights (when its GGUF was staged: benchmarks/gpu_stage_gguf.sh, then
#    GPU_EMBEDDED="/tmp/smol.gguf /tmp/g/hf /tmp/g/hashes.json"): dequantized by this app's reader (hash-checked
#    against the CPU conversion) into an fp32 folder, then `bench` on CUDA with the shipped drafts: real
#    acceptance, identity with the plain loop and HF generate, NF4 and 16-bit. GPU_EMBEDDED_RUNS picks the
#    (heads, quant) pairs (default: hydra none, hydra nf4, eagle3 none, medusa-1 nf4).
if [ -n "${GPU_EMBEDDED:-}" ]; then
    read -r e_gguf e_hf e_hashes <<<"$GPU_EMBEDDED"
    e_model=/tmp/embedded-fp32
    stage embedded_prepare "${GPU_PREP_S:-120}" "$py" -c "
import json, sys
from pathlib import Path
sys.path.insert(0, 'benchmarks')
from gpu_train_heads import prepare_model, tensor_hashes
from safetensors.torch import load_file
work = Path('/tmp/embedded-work'); work.mkdir(exist_ok=True)
folder = prepare_model('$e_gguf', work, '$e_hf', print)
want = json.loads(Path('$e_hashes').read_text())
got = tensor_hashes({k: v for k, v in load_file(str(folder / 'model.safetensors')).items() if k in want})
bad = [k for k in want if got.get(k) != want[k]]
print('weights vs the CPU conversion:', 'identical' if not bad else f'{len(bad)} tensors differ')
Path('$e_model').unlink(missing_ok=True); Path('$e_model').symlink_to(folder.resolve())
sys.exit(1 if bad else 0)"
    for run in ${GPU_EMBEDDED_RUNS:-hydra:none hydra:nf4 eagle3:none medusa-1:nf4}; do
        heads=${run%%:*} q=${run##*:}
        folder=assets/smollm2-135m$([ "$heads" = hydra ] || echo "-${heads//-/}")
        base=plain$([ "$run" = hydra:none ] && echo ",hf")
        MEDUSA_CHAT_CACHE=/tmp/embedded-cache stage "embedded_${heads}_$q" "${GPU_EMB_S:-120}" "$py" -m medusa_chat \
            bench --model "$e_model" --heads "$folder" --device "${GPU_EMBEDDED_DEVICE:-cuda}" --quant "$q" --warmup 1 --quiet \
            --prompts benchmarks/data/vicuna_bench_question.jsonl --limit 10 --max-new-tokens 64 --baselines "$base" \
            --json "$out/embedded_${heads}_$q.json"
    done
fi
cat "$out/stages.txt"
