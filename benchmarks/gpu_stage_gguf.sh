#!/usr/bin/env bash
# Stage the embedded model's GGUF for a GPU machine that has no network and takes at most CARRY_LIMIT_MB (default
# 64) MiB per call, the repository itself included (~46 MB with the shipped drafts): pieces under ./.gpu (git-ignored), one carried
# by each call, joined on the machine. Also the converted model's config/tokenizer files and the fp32 weights'
# hashes, so gpu_train_heads.py dequantizes the GGUF there with this app's reader (no `gguf` package needed)
# and checks that the weights are bit for bit the ones the heads will run with.
#
#   bash benchmarks/gpu_prepare.sh && bash benchmarks/gpu_stage_gguf.sh
# then one call per piece, each within the machine's warm window (30 s), the first also carrying .whl:
#   call 0 (carry .whl, .gpu/p0): mkdir -p /tmp/whl /tmp/g && cp -r .whl/site /tmp/whl/ && cp .gpu/p0/* /tmp/g/
#   call i (carry .gpu/pI):       cp -r .gpu/pI/* /tmp/g/
#   last: cat /tmp/g/g.* > /tmp/smol.gguf && export PYTHONPATH=/tmp/whl/site:$PWD && python3 \
#         benchmarks/gpu_train_heads.py /tmp/smol.gguf /tmp/out --hf-files /tmp/g/hf --expect-hashes \
#         /tmp/g/hashes.json --minutes 9 ... (then the files of /tmp/out to $OUT, split below 16 MB)
# With the shipped data (`--import-data benchmarks/data/distill_smollm2_h200_2026-12-04.npz --data-frac 0`)
# the whole budget trains. The piece names sort in order (g.00, g.01, ...), so `cat /tmp/g/g.*` joins them.
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-.venv/bin/python}"
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >>.git/info/exclude
gguf=$("$py" -c "from medusa_chat.model.sources.embedded import gguf_path; print(gguf_path() or '')")
hf=$("$py" -c "from medusa_chat.model.sources.embedded import embedded_model_dir; print(embedded_model_dir())")
[ -n "$gguf" ] && [ -f "$hf/model.safetensors" ] || { echo "run medusa-chat once first (the converted model)"; exit 1; }
tracked=$(git ls-files -z | du -cb --files0-from=- | tail -1 | cut -f1)
whl=$(du -sb .whl 2>/dev/null | cut -f1 || echo 0)
# CARRY_LIMIT_MB: what one call to the GPU machine may carry (the repository included); 5 MiB of slack for the
# tokenizer files and untracked files
limit=$((${CARRY_LIMIT_MB:-64} * 1024 * 1024 - 5 * 1024 * 1024))
room=$((limit - tracked))
first=$((room - whl))
size=$(stat -c %s "$gguf")
if [ "$first" -lt $((1024 * 1024)) ]; then
    echo "the repository ($tracked bytes) and .whl ($whl) leave no room for a piece"
    exit 1
fi
rm -rf .gpu
offset=0
i=0
while [ "$offset" -lt "$size" ]; do
    n=$([ "$i" -eq 0 ] && echo "$first" || echo "$room")
    dir=.gpu/p$i
    mkdir -p "$dir"
    dd if="$gguf" of="$dir/g.$(printf %02d "$i")" bs=1M iflag=skip_bytes,count_bytes skip="$offset" count="$n" \
        status=none
    offset=$((offset + n))
    i=$((i + 1))
done
cmp <(for f in $(printf "%s\n" .gpu/p*/g.* | sort -t/ -k3); do cat "$f"; done) "$gguf"
last=.gpu/p$((i - 1))
mkdir -p "$last/hf"
for f in config.json generation_config.json tokenizer.json tokenizer_config.json chat_template.jinja; do
    if [ -f "$hf/$f" ]; then cp "$hf/$f" "$last/hf/"; fi
done
"$py" - "$hf/model.safetensors" "$last/hashes.json" <<'PY'
import hashlib
import json
import sys

from safetensors.torch import load_file

state = load_file(sys.argv[1])
hashes = {k: hashlib.sha256(v.float().contiguous().numpy().tobytes()).hexdigest() for k, v in sorted(state.items())}
json.dump(hashes, open(sys.argv[2], "w"))
PY
echo "$i pieces (the repository: $tracked bytes; .whl: $whl):"
du -sh .gpu/p*
