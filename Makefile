# Everything installs into .venv, pinned (requirements.txt + constraints.txt keep torch at 2.13.0 CPU).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q -c constraints.txt

BENCH_VENV ?= .venv-bench
BENCH_PY := $(BENCH_VENV)/bin/python

.PHONY: install demo test sentiment bench bench-install clean
install: $(VENV)/.installed

$(VENV)/.installed: requirements.txt requirements-nodeps.txt constraints.txt pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) -r requirements.txt
	$(PIP) --no-deps -r requirements-nodeps.txt
	$(PIP) --no-deps --no-build-isolation -e .
	touch $@

demo: install          ## tune the shipped MNIST CNN on real digits, SQLite study under studies/
	$(PY) -m autotune.workloads.mnist

test: install          ## lint, then the test suite
	$(VENV)/bin/ruff check autotune tests benchmarks
	$(PY) -m pytest -q --durations=15 tests

sentiment: install     ## MiniLM encoder + sentiment head on human-rated movie sentences (prepares a data cache first)
	$(PY) -m autotune.workloads.sentiment_data
	$(VENV)/bin/autotune tune configs/minilm_sentiment.yaml

bench-install: $(BENCH_VENV)/.installed

# The benchmark environment adds Intel Neural Compressor (a peer to compare with) to the same pins.
$(BENCH_VENV)/.installed: requirements.txt requirements-nodeps.txt constraints.txt pyproject.toml benchmarks/requirements-bench.txt
	test -x $(BENCH_PY) || python3 -m venv $(BENCH_VENV)
	$(BENCH_PY) -m pip install -q -c constraints.txt -r requirements.txt -r benchmarks/requirements-bench.txt
	$(BENCH_PY) -m pip install -q -c constraints.txt --no-deps -r requirements-nodeps.txt
	$(BENCH_PY) -m pip install -q -c constraints.txt --no-deps --no-build-isolation -e .
	touch $@

bench: bench-install   ## search benchmark (writes benchmarks/results.md), then the deployment table vs the peers
	$(BENCH_PY) benchmarks/harness.py
	$(BENCH_PY) benchmarks/deploy.py

clean:
	rm -rf $(VENV) $(BENCH_VENV) studies/*.db

# Heavy (4-7 minutes, ~2.5 GB of images): never part of `test`. Needs a docker daemon, or root to start one.
.PHONY: docker
docker:                ## build the image, validate docker/compose.yaml, run the stack with a tiny job, clean up
	bash docker/smoke.sh

# The CUDA tests, on a GPU machine and with its own CUDA build of torch (never .venv, whose pinned torch is CPU-only):
# `make test-gpu` in the checkout there. Wheels of the other dependencies carried in .whl/ are installed into
# GPU_SITE first; the CUDA tests then fail rather than skip if torch sees no GPU. `make bench-gpu` runs the GPU
# benchmark the same way (benchmarks/gpu.py, BENCH_GPU_ARGS passed on; writes benchmarks/results-gpu.md).
GPU_PY ?= python3
GPU_SITE ?= /tmp/autotune-gpu-site
CUDA_TESTS ?= tests/test_cuda.py tests/test_backends.py::test_half_backends_on_cuda
BENCH_GPU_ARGS ?=
GPU_ENV = PYTHONPATH=$(GPU_SITE):$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1

.PHONY: gpu-site test-gpu bench-gpu
gpu-site:              ## checks that GPU_PY's torch sees CUDA; installs the wheels carried in .whl/ into GPU_SITE
	@$(GPU_PY) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else \
	  f'$(MAKECMDGOALS): torch {torch.__version__} in {sys.executable} sees no CUDA device')"
	if [ -d .whl ]; then $(GPU_PY) -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
	  --target $(GPU_SITE) .whl/*.whl; fi

test-gpu: gpu-site     ## the CUDA tests with the GPU machine's own torch (GPU_PY); other wheels from .whl/
	AUTOTUNE_REQUIRE_CUDA=1 $(GPU_ENV) $(GPU_PY) -m pytest -q -rs -p no:cacheprovider $(CUDA_TESTS)

bench-gpu: gpu-site    ## the GPU benchmark with the GPU machine's own torch: fp32, TF32, AMP, .half(), compile, CUDA graphs, autotune
	$(GPU_ENV) $(GPU_PY) benchmarks/gpu.py $(BENCH_GPU_ARGS)
