#!/usr/bin/env bash
# Train the zoo's MoE pair on a GPU: moe_target (Qwen3-MoE), then moe_eagle3 distilled from it.
#
# Usage: bash tools/train_moe_zoo.sh PREPARED OUT
#   PREPARED  the corpus folder `funcspec train prepare --out PREPARED` wrote where the stdlib is
#             (token stream, manifests, tokenizer): this machine needs no stdlib of its own.
#   OUT       receives train.log and moe_zoo.tar.part-0, -1, ...: one tar of models/moe_target and
#             models/moe_eagle3, split below 16 MB a part. Unpack: cat OUT/moe_zoo.tar.part-* | tar -x -C models
# Environment: DEVICE (default cuda), MOE_TARGET_STEPS / MOE_EAGLE3_STEPS (default: the recipes' own),
# MOE_TARGET_BUDGET / MOE_EAGLE3_BUDGET (seconds of training each, default 240 / 120: a schedule that
# would not fit is shortened at the pace of its first steps, so the whole run stays under 8 minutes),
# PYTHON (default python3). Why a script: the GPU machine has no network and no copy of this stdlib.
set -euo pipefail
[ $# -eq 2 ] || { echo "usage: $0 PREPARED OUT" >&2; exit 2; }
mkdir -p "$2"
prep=$(cd "$1" && pwd)
out=$(cd "$2" && pwd)
cd "$(dirname "$0")/.."
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}" FUNCSPEC_CPU_KERNELS=0 PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
common=(--device "${DEVICE:-cuda}" --corpus-cache "$prep" --models "$tmp/models" --work "$tmp/work")
{
    date -u +"start %FT%TZ"
    "$py" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__,
'gpu', torch.cuda.get_device_name() if torch.cuda.is_available() else None)"
    SECONDS=0
    "$py" -m funcspec.train moe_target "${common[@]}" --time-budget "${MOE_TARGET_BUDGET:-240}" \
        ${MOE_TARGET_STEPS:+--steps "$MOE_TARGET_STEPS"}
    echo "moe_target done after ${SECONDS}s"
    "$py" -m funcspec.train moe_eagle3 "${common[@]}" --time-budget "${MOE_EAGLE3_BUDGET:-120}" \
        ${MOE_EAGLE3_STEPS:+--steps "$MOE_EAGLE3_STEPS"}
    echo "moe_eagle3 done after ${SECONDS}s"
    for role in moe_target moe_eagle3; do  # the checkpoint and the loss curve (log.jsonl: every 25 steps)
        ls -l "$tmp/models/$role"
        cat "$tmp/work/$role/log.jsonl" 2>/dev/null || true
    done
} 2>&1 | tee "$out/train.log"
rm -f "$out"/moe_zoo.tar.part-*
tar -C "$tmp/models" -cf - moe_target moe_eagle3 | split -b 15M -d -a 1 - "$out/moe_zoo.tar.part-"
ls -l "$out" | tee -a "$out/train.log"
