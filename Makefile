# The README's quick start is exactly `make demo` and `make test` on a fresh machine.
# Both create or reuse .venv and install what they need: the CPU build of torch 2.13.0
# (a file already on disk here; never a bare `torch`, which pulls a multi-GB CUDA build),
# triton 3.6.0 (runs kernels on the CPU with TRITON_INTERPRET=1), and flaloop itself with its extras
# (ray among them: the sweep's Ray executor is tested on a real local Ray cluster).

PYTHON ?= python3
VENV   := .venv
VPY    := $(VENV)/bin/python
STAMP  := $(VENV)/.flaloop-installed

.PHONY: setup test demo lint clean

# pip byte-compiles what it installs one file at a time; compileall does it on every core (R31:
# 43.3 s for pip alone, 23.6 s + 14.8 s this way). A file written for a newer Python (torch ships one)
# fails to compile either way, and pip skips it silently too: hence `|| true` and no output.
$(STAMP): pyproject.toml Makefile
	@test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install --quiet --disable-pip-version-check --no-compile torch==2.13.0 triton==3.6.0 -e '.[dev,gpu,ray,mcp]'
	@$(VPY) -m compileall -j 0 -q $$($(VPY) -c 'import sysconfig; print(sysconfig.get_path("purelib"))') >/dev/null 2>&1 || true
	@touch $@

setup: $(STAMP)

# The longest test modules start first (tests/conftest.py, LONGEST_FIRST): xdist keeps that order.
# Three xdist workers on the 2-core CI machine: a test waits on its subprocesses (fork servers,
# sleeping toy ops, Ray) much of the time, and a third worker fills those waits (docs/lab/2026-12-04-cpu.md R30).
# Byte-compile flaloop first: with PYTHONDONTWRITEBYTECODE=1 (set on these machines) Python never
# writes a .pyc, and each of the suite's hundreds of processes would compile flaloop from source.
# One BLAS and one OpenMP thread a process: the suite's processes (three workers' CLI runs, gates,
# bench workers) share two cores, where every pool's threads spin on cores the others need
# (R31: 0.1 CPU-s of OpenBLAS start-up in each process that imports torch or numpy). No test
# depends on a thread count; the bench's workers hold torch to one thread on the CPU anyway.
TEST_ENV := TRITON_INTERPRET=1 OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
test: setup
	$(VPY) -m compileall -q flaloop
	$(TEST_ENV) $(VPY) -m pytest -q -n 3 --dist loadscope --no-loadscope-reorder tests

demo: setup
	$(VPY) -m compileall -q flaloop
	TRITON_INTERPRET=1 $(VPY) -m flaloop demo

lint: setup
	$(VPY) -m ruff check flaloop tests benchmarks examples

clean:
	rm -rf $(VENV) build *.egg-info
