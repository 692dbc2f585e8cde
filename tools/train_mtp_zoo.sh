#!/usr/bin/env bash
# Train the zoo's mtp_target on a GPU: a tiny DeepSeek-V3 (MLA, DeepSeekMoE) with its own MTP module
# (funcspec/train/mtp_target.py).
#
# Usage: bash tools/train_mtp_zoo.sh PREPARED OUT
#   PREPARED  the corpus folder `funcspec train prepare --out PREPARED` wrote where the stdlib is
#             (token stream, manifests, tokenizer): this machine needs no stdlib of its own.
#   OUT       receives train.log, train.json and mtp_zoo.tar.part-0, -1, ...: one tar of models/mtp_target,
#             split below 16 MB a part. Unpack: cat OUT/mtp_zoo.tar.part-* | tar -x -C models
# Environment: DEVICE (default cuda), MTP_TARGET_STEPS (default: the recipe's own), MTP_TARGET_BUDGET
# (seconds of training, default 150: a schedule that would not fit is shortened at the pace of its first
# steps), SMOKE (default 1: first a 2-step run of the same command into a scratch folder, so a failure
# shows in seconds, not after the budget; 0 skips it), PYTHON (default python3).
# Why a script: the GPU machine has no network and no copy of this stdlib. The whole run takes about
# 3.5 minutes on an H200 (start-up, smoke run, 150 s of training, save and check).
set -euo pipefail
[ $# -eq 2 ] || { echo "usage: $0 PREPARED OUT" >&2; exit 2; }
mkdir -p "$2"
prep=$(cd "$1" && pwd)
out=$(cd "$2" && pwd)
cd "$(dirname "$0")/.."
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}" FUNCSPEC_CPU_KERNELS=0 PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
py=${PYTHON:-python3}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
common=(--device "${DEVICE:-cuda}" --corpus-cache "$prep")
{
    date -u +"start %FT%TZ"
    "$py" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__,
'gpu', torch.cuda.get_device_name() if torch.cuda.is_available() else None)"
    SECONDS=0
    if [ "${SMOKE:-1}" != 0 ]; then
        "$py" -m funcspec.train mtp_target "${common[@]}" --models "$tmp/smoke" --work "$tmp/smoke-work" --steps 2
        echo "smoke run done after ${SECONDS}s"
    fi
    "$py" -m funcspec.train mtp_target "${common[@]}" --models "$tmp/models" --work "$tmp/work" \
        --time-budget "${MTP_TARGET_BUDGET:-150}" ${MTP_TARGET_STEPS:+--steps "$MTP_TARGET_STEPS"}
    echo "mtp_target done after ${SECONDS}s"
    ls -l "$tmp/models/mtp_target"
    cat "$tmp/work/mtp_target/log.jsonl"  # the loss curve: every 25 steps, ce and mtp apart
    cat "$tmp/models/mtp_target/train.json"
} 2>&1 | tee "$out/train.log"
cp "$tmp/models/mtp_target/train.json" "$out/train.json"
rm -f "$out"/mtp_zoo.tar.part-*
tar -C "$tmp/models" -cf - mtp_target | split -b 15M -d -a 1 - "$out/mtp_zoo.tar.part-"
ls -l "$out" | tee -a "$out/train.log"
