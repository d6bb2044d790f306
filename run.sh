#!/usr/bin/env bash
# Reproduce the current record on whatever machine this runs on.
#   GPUs: what `train_gpt.py --plan` picks for their count and memory and the host's
#         (memory_budget.launch_plan): the largest configuration that fits, from the speedrun
#         preset on 8 of them (an 8xH100 record attempt) down through the 1gpu preset (the same
#         global batch by gradient accumulation) with the n-gram table split across 4 or 2 GPUs,
#         whole on one or in host memory, smaller tables and micro-batches (docs/gpu.md); it
#         prints the one line that says what it chose and what that costs, or what to change.
#   no GPU: the cpu preset (the CPU track) on the tiny offline corpus, or another preset that
#         trains on it (cpu_optimization).
# Missing data is fetched or built first. Extra arguments pass through to train_gpt.py,
# e.g. ./run.sh --num_iterations=100 --seed=1; a --preset or --config of your own replaces
# the machine's preset. A relative --config or --log_dir is a path from where you stand.
set -euo pipefail
here=$PWD
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}

fail() { echo "run.sh: $*" >&2; exit 2; }

# --config PATH, --config=PATH, --log_dir PATH and --log_dir=PATH from the folder run.sh was
# started in (it runs from the repository's).
from_here() { case "$1" in /* | "") printf '%s' "$1" ;; *) printf '%s' "$here/$1" ;; esac; }
args=()
path_follows=0
for arg in "$@"; do
    if [ "$path_follows" = 1 ]; then args+=("$(from_here "$arg")"); path_follows=0; continue; fi
    case "$arg" in
        --config | --log_dir) args+=("$arg"); path_follows=1 ;;
        --config=*) args+=("--config=$(from_here "${arg#--config=}")") ;;
        --log_dir=*) args+=("--log_dir=$(from_here "${arg#--log_dir=}")") ;;
        *) args+=("$arg") ;;
    esac
done
set -- ${args[@]+"${args[@]}"}

command -v "$PYTHON" >/dev/null || fail "$PYTHON: no such Python (set PYTHON to a Python 3 interpreter)"
# The oldest Python the requirements install on: train_gpt.py's MIN_PYTHON.
read -r major minor <<< "$(sed -n 's/.*MIN_PYTHON := (\([0-9]*\), \([0-9]*\)).*/\1 \2/p' train_gpt.py)"
version=$("$PYTHON" -c "import sys; print('%d.%d.%d' % sys.version_info[:3]); sys.exit(sys.version_info < ($major, $minor))") \
    || fail "Python $major.$minor or newer is needed; $PYTHON is Python ${version:-unknown}: set PYTHON to a newer one, e.g. PYTHON=python$major.$minor ./run.sh"
"$PYTHON" -c "import torch" 2>/dev/null || fail "torch is not installed for $PYTHON: run 'pip install -r requirements.txt' first"
# Three lines: the GPU count, every preset, the presets that train on the tiny corpus (a CPU's data).
machine=$("$PYTHON" -c "
import torch, train_gpt as t
print(torch.cuda.device_count())
print(' '.join(t.PRESETS))
print(' '.join(n for n in t.PRESETS if t.parse_config(['--preset', n]).train_files.startswith('data/tiny_corpus/')))
") || fail "train_gpt.py cannot be imported (see above)"
gpus=$(sed -n 1p <<< "$machine")
presets=$(sed -n 2p <<< "$machine")
cpu_presets=$(sed -n 3p <<< "$machine")

# The preset the user chose, if any (--preset NAME, --preset=NAME, or a --config file).
chosen=""
for ((i = 1; i <= $#; i++)); do
    case "${!i}" in
        --config|--config=*) chosen="config" ;;
        --preset=*) chosen="${!i#--preset=}" ;;
        --preset) j=$((i + 1)); chosen="${!j:-}" ;;
    esac
done

case " $presets config " in
    *" $chosen "*) ;;
    *) [ -z "$chosen" ] || fail "unknown preset '$chosen': the presets are ${presets// /, }" ;;
esac

if [ "$gpus" -eq 0 ]; then
    case " $cpu_presets config " in
        *" $chosen "*) ;;
        *) [ -z "$chosen" ] || fail "the $chosen preset needs GPUs and FineWeb; this machine has none: run ./run.sh without --preset (the cpu preset), or with one of: ${cpu_presets// /, }" ;;
    esac
    "$PYTHON" data/tiny_corpus.py --if-missing || fail "could not build the tiny corpus (see the line above)"
    if [ -n "$chosen" ]; then exec "$PYTHON" train_gpt.py "$@"; fi
    exec "$PYTHON" train_gpt.py --preset cpu "$@"
fi

# Three lines: the process count, the preset arguments (none with the user's own), the reason.
plan=$("$PYTHON" train_gpt.py --plan "$@") || exit $?
nproc=$(sed -n 1p <<< "$plan")
read -ra preset_args <<< "$(sed -n 2p <<< "$plan")"

echo "run.sh: $(sed -n 3p <<< "$plan")"
# Two words: the train shards the run reads, and its track.
needs=$("$PYTHON" -c "import sys, train_gpt as t; h = t.parse_config(sys.argv[1:]); print(t.train_shards_needed(h), h.track)" \
    "${preset_args[@]}" "$@") || fail "bad arguments for train_gpt.py (see above)"
read -r shards track <<< "$needs"
if [ "$nproc" -eq 1 ] && [ "$track" = track_1gpu ]; then
    echo "run.sh: one GPU: the single-GPU track's recipe (records/track_1gpu/README.md: a record runs on one H100 or H200)"
fi
"$PYTHON" data/cached_fineweb10B.py "$shards" || exit $?

exec "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node="$nproc" train_gpt.py "${preset_args[@]}" "$@"
