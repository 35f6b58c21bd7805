#!/usr/bin/env bash
# flaloop's GPU-only tests on the device machine (its python3 has CUDA torch, triton, pytest,
# typer, rich, scipy, nvidia-ml-py): CUDA-graph capture and proof in the worker, an A/A bench
# of examples/minifla with NVML clock readings. Usage (device): bash benchmarks/gpu_selftest.sh
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
python3 -m pytest -q -m gpu -p no:cacheprovider tests "$@"
