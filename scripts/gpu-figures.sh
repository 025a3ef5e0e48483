#!/usr/bin/env bash
# Every GPU figure the docs still lack, in one call, into the folder given (scripts/gpu_figures.py):
#   bash scripts/gpu-figures.sh OUT          on one CUDA GPU, budgeted at about six minutes
#   bash scripts/gpu-figures.sh OUT --tiny   the dry run a CPU can make
exec python3 "$(dirname "$0")/gpu_figures.py" "$@"
