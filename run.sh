#!/usr/bin/env bash
# Reproduce the current record on whatever machine this runs on.
#   GPUs: what `train_gpt.py --plan` picks for their count and memory (train_gpt.launch_plan):
#         the speedrun preset on 8 of them (an 8xH100 record attempt); else the 1gpu preset
#         (the same global batch by gradient accumulation) on 4 or 2 of them with the n-gram
#         table split across their memory, or on one with the table in host memory; it prints
#         the one line that says what it chose and why, or the one line that says what to change.
#   no GPU: the cpu preset (the CPU track) on the tiny offline corpus.
# Missing data is fetched or built first. Extra arguments pass through to train_gpt.py,
# e.g. ./run.sh --num_iterations=100 --seed=1; a --preset or --config of your own replaces
# the machine's preset.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}

fail() { echo "run.sh: $*" >&2; exit 2; }

command -v "$PYTHON" >/dev/null || fail "$PYTHON: no such Python (set PYTHON to a Python 3 interpreter)"
"$PYTHON" -c "import torch" 2>/dev/null || fail "torch is not installed for $PYTHON: run 'pip install -r requirements.txt' first"
gpus=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())")

# The preset the user chose, if any (--preset NAME, --preset=NAME, or a --config file).
chosen=""
for ((i = 1; i <= $#; i++)); do
    case "${!i}" in
        --config|--config=*) chosen="config" ;;
        --preset=*) chosen="${!i#--preset=}" ;;
        --preset) j=$((i + 1)); chosen="${!j:-}" ;;
    esac
done

if [ "$gpus" -eq 0 ]; then
    case "$chosen" in
        ""|cpu|config) ;;
        *) fail "the $chosen preset needs GPUs and FineWeb; this machine has none: run ./run.sh without --preset (the cpu preset)" ;;
    esac
    "$PYTHON" data/tiny_corpus.py --if-missing || fail "could not build the tiny corpus (see the line above)"
    if [ -n "$chosen" ]; then exec "$PYTHON" train_gpt.py "$@"; fi
    exec "$PYTHON" train_gpt.py --preset cpu "$@"
fi

# Three lines: the process count, the preset arguments (none with the user's own), the reason.
plan=$("$PYTHON" train_gpt.py --plan "$@") || exit $?
nproc=$(sed -n 1p <<< "$plan")
read -ra preset_args <<< "$(sed -n 2p <<< "$plan")"

shards=$("$PYTHON" -c "import sys, train_gpt as t; print(t.train_shards_needed(t.parse_config(sys.argv[1:])))" \
    "${preset_args[@]}" "$@") || fail "bad arguments for train_gpt.py (see above)"
"$PYTHON" data/cached_fineweb10B.py "$shards" || exit $?

echo "run.sh: $(sed -n 3p <<< "$plan")"
exec "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node="$nproc" train_gpt.py "${preset_args[@]}" "$@"
