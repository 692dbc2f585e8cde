#!/usr/bin/env bash
# Train zoo roles on a GPU, in order: the MoE pair (moe_target, then moe_eagle3 distilled from it), or
# mtp_target (a tiny DeepSeek-V3 with its own MTP module).
#
# Usage: bash tools/train_zoo_gpu.sh PREPARED OUT ROLE [ROLE ...]
#   PREPARED  the corpus folder `funcspec train prepare --out PREPARED` wrote where the stdlib is
#             (token stream, manifests, tokenizer): this machine needs no stdlib of its own.
#   OUT       receives train.log, <ROLE>.train.json and zoo.tar.part-0, -1, ...: one tar of models/<ROLE>...,
#             split below 16 MB a part. Unpack: cat OUT/zoo.tar.part-* | tar -x -C models
# Environment: DEVICE (default cuda); STEPS_<ROLE> (default: the recipe's own); BUDGET_<ROLE> (seconds of
# training; default 240 for moe_target, 120 for moe_eagle3, 150 for mtp_target: a schedule that would not
# fit is shortened at the pace of its first steps); SMOKE (default 1: first a 2-step run of the first role
# into a scratch folder, so a failure shows in seconds, not after the budget; 0 skips it); PYTHON
# (default python3). Why a script: the GPU machine has no network and no copy of this stdlib.
set -euo pipefail
[ $# -ge 3 ] || { echo "usage: $0 PREPARED OUT ROLE [ROLE ...]" >&2; exit 2; }
mkdir -p "$2"
prep=$(cd "$1" && pwd)
out=$(cd "$2" && pwd)
shift 2
cd "$(dirname "$0")/.."
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}" FUNCSPEC_CPU_KERNELS=0 PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
py=${PYTHON:-python3}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
common=(--device "${DEVICE:-cuda}" --corpus-cache "$prep")
budget() { case $1 in moe_target) echo 240 ;; moe_eagle3) echo 120 ;; *) echo 150 ;; esac; }
{
    date -u +"start %FT%TZ"
    "$py" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__,
'gpu', torch.cuda.get_device_name() if torch.cuda.is_available() else None)"
    SECONDS=0
    if [ "${SMOKE:-1}" != 0 ]; then
        "$py" -m funcspec.train "$1" "${common[@]}" --models "$tmp/smoke" --work "$tmp/smoke-work" --steps 2
        echo "smoke run done after ${SECONDS}s"
    fi
    for role in "$@"; do
        steps="STEPS_$role" secs="BUDGET_$role"
        "$py" -m funcspec.train "$role" "${common[@]}" --models "$tmp/models" --work "$tmp/work" \
            --time-budget "${!secs:-$(budget "$role")}" ${!steps:+--steps "${!steps}"}
        echo "$role done after ${SECONDS}s"
        ls -l "$tmp/models/$role"
        cat "$tmp/work/$role/log.jsonl" 2>/dev/null || true  # the loss curve: every 25 steps
        cp "$tmp/models/$role/train.json" "$out/$role.train.json"
    done
} 2>&1 | tee "$out/train.log"
rm -f "$out"/zoo.tar.part-*
tar -C "$tmp/models" -cf - "$@" | split -b 15M -d -a 1 - "$out/zoo.tar.part-"
ls -l "$out" | tee -a "$out/train.log"
