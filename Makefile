# Everything installs into .venv, pinned (requirements.txt + constraints.txt keep torch at 2.13.0 CPU).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q -c constraints.txt

.PHONY: install demo test bench clean
install: $(VENV)/.installed

$(VENV)/.installed: requirements.txt requirements-nodeps.txt constraints.txt pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) -r requirements.txt
	$(PIP) --no-deps -r requirements-nodeps.txt
	$(PIP) --no-deps --no-build-isolation -e .
	touch $@

demo: install          ## tune the shipped MNIST CNN on real digits, SQLite study under studies/
	$(PY) -m autotune.workloads.mnist

test: install          ## the test suite
	$(PY) -m pytest -q tests

bench: install         ## MNIST tuning benchmark: latency ratio, accuracy, eval calls, wall time
	$(PY) benchmarks/mnist_tuning.py

clean:
	rm -rf $(VENV) studies/*.db
