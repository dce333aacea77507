#!/usr/bin/env bash
# Stage the embedded model's GGUF for a GPU machine with no network, in pieces whose sizes the plan gives (each
# piece fills what its command leaves free: `python benchmarks/gpu_4bit.py plan` prints this script's command
# line under prepare_here). Piece i goes to ./.gpu/pI (git-ignored) and is carried by
# the plan's command that names it; gpu_checks.sh joins them on the machine. The last piece also holds the
# converted model's config/tokenizer files (hf/) and the fp32 weights' hashes (hashes.json), so the machine
# dequantizes the GGUF with this app's reader (no `gguf` package needed) and checks that the weights are bit for
# bit the ones the CPU converted.
#
#   bash benchmarks/gpu_stage_gguf.sh BYTES_0 [BYTES_1 ...]   # the last piece takes whatever is left
#
# The piece names sort in order (g.00, g.01, ...), so `cat g.*` joins them.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$#" -ge 1 ] || { echo "usage: gpu_stage_gguf.sh BYTES_0 [BYTES_1 ...] (the plan prints them)"; exit 2; }
py="${PYTHON:-.venv/bin/python}"
gguf=$("$py" -c "from medusa_chat.model.sources.embedded import gguf_path; print(gguf_path() or '')")
hf=$("$py" -c "from medusa_chat.model.sources.embedded import embedded_model_dir; print(embedded_model_dir())")
[ -n "$gguf" ] && [ -f "$hf/model.safetensors" ] || { echo "run medusa-chat once first (the converted model)"; exit 1; }
size=$(stat -c %s "$gguf")
rm -rf .gpu
offset=0
i=0
sizes=("$@")
while [ "$offset" -lt "$size" ]; do
    n=$([ "$i" -lt $(($# - 1)) ] && echo "${sizes[$i]}" || echo $((size - offset)))
    [ "$n" -gt 0 ] || { echo "piece $i is empty"; exit 1; }
    mkdir -p ".gpu/p$i"
    dd if="$gguf" of=".gpu/p$i/g.$(printf %02d "$i")" bs=1M iflag=skip_bytes,count_bytes skip="$offset" \
        count="$n" status=none
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
echo "$i pieces:"
du -sb .gpu/p*
