# Two entry points that do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.moetune-installed

.PHONY: demo test install server lint-imports clean

install: $(STAMP)

$(STAMP): pyproject.toml setup.py bench/gpu_check_requirements.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# The GPU check's list pins the whole closure of what the suite imports (transformers' own requirements too):
	# as constraints here, a new release of a package nobody pins (httpx2, regex, ...) cannot change what the suite
	# runs, nor leave the GPU host a version the suite never ran (tests/kernels/test_gpu_check_dry_run.py).
	$(BIN)/python -m pip install -q -c bench/gpu_check_requirements.txt -e '.[test]'
	# tinker-cookbook's loops run against the Tinker router (tests/tinker/test_cookbook.py): without its requirements,
	# as tml-renderers>=0.4.1 is not on the package index (its loops never import it); what they do import is in
	# the [test] extra.
	$(BIN)/python -m pip install -q --no-deps tinker-cookbook==0.6.1
	# fla-core's wheel (the [cuda] extra's pin), downloaded, never installed (transformers dispatches to fla whenever
	# it is importable): tests/kernels/test_kda_fla.py imports it in a child process to build its launches for sm_90.
	$(BIN)/python -m pip download -q --no-deps -d $(VENV)/wheels fla-core==0.6.0
	# Kimi K3's reference (NeMo Automodel + fla, --no-deps, outside the venv for the same reason): the K3 tests run
	# it in a child process (bench/support/kimi_k3_reference.py), and so does bench/k3_step.py.
	$(BIN)/python bench/support/kimi_k3_reference.py
	# DeepSpeed JIT-compiles one C++ op (shm_comm) in init_distributed: build it now, into this virtualenv
	# (workers look for it there: moetune.workers.settings), so no job waits ~40 s for a compiler.
	$(BIN)/python -m moetune.workers.engine.prebuild
	touch $@

demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/moetune demo

# Two workers: the suite keeps both cores busy (4,370 CPU-s in 2,289 s on three workers, 1.9 cores), so a third
# worker overlapped no waiting; it added a Ray head (~4 CPU-s a minute) and contention. Two: 3,804 CPU-s in 2,069 s
# (a reinstall included), none of the load failures (tests/conftest.py).
# Bytecode is written even where the environment says not to (PYTHONDONTWRITEBYTECODE): hundreds of processes
# (Ray workers, children) import the same moetune modules, and each would compile them again (~0.5 s apiece).
test: $(STAMP)
	PYTHONDONTWRITEBYTECODE= HF_HUB_OFFLINE=1 $(BIN)/pytest -n 2 --dist loadgroup --no-loadscope-reorder

server: $(STAMP)
	$(BIN)/moetune server

clean:
	rm -rf $(VENV) .moetune .pytest_cache
