#!/usr/bin/env bash
# Every GPU figure the docs still lack, in two calls of under eight minutes each, into the folder given
# (scripts/gpu_figures.py; --plan prints the rows and their estimates without running them):
#   bash scripts/gpu-figures.sh OUT          on one CUDA GPU: the rows the goals need
#   bash scripts/gpu-figures.sh OUT --more   on one CUDA GPU: the rest
#   bash scripts/gpu-figures.sh OUT --tiny   the dry run a CPU can make, every row
exec python3 "$(dirname "$0")/gpu_figures.py" "$@"
