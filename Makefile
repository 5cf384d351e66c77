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
	$(PY) -m pytest -q tests

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

bench: bench-install   ## search benchmark vs INC, uniform, random, oracle, simulator: writes benchmarks/results.md
	$(BENCH_PY) benchmarks/harness.py

clean:
	rm -rf $(VENV) $(BENCH_VENV) studies/*.db

# Heavy (4-7 minutes, ~2.5 GB of images): never part of `test`. Needs a docker daemon, or root to start one.
.PHONY: docker
docker:                ## build the image, validate docker/compose.yaml, run the stack with a tiny job, clean up
	bash docker/smoke.sh
