# QuillCache — one target per step: install → test / bench / experiments → figures → paper.
# `clean` removes build artefacts only; results/ is never deleted by any target.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.installed
XSTAMP := $(VENV)/.installed-experiments
PYX    := $(shell find quillcache -name '*.pyx' -o -name '*.pxd' -o -name '*.pxi' -o -name '*.h')

export PYTHONFAULTHANDLER := 1

.PHONY: install test bench storage store crash safety hitrate replay experiments figures paper clean

install: $(STAMP)

$(STAMP): setup.py pyproject.toml $(PYX)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -e '.[dev]'
	touch $(STAMP)

# The studies' extra baselines (libCacheSim) on top of the dev install; tests never need them.
$(XSTAMP): $(STAMP)
	$(PIP) install --quiet -e '.[dev,experiments]'
	touch $(XSTAMP)

test: install
	$(PY) -m pytest -q

bench: install
	$(PY) -m experiments.microbench.run_all

storage: install
	$(PY) -m experiments.storage_study

store: install
	$(PY) -m experiments.store_bench_dram
	$(PY) -m experiments.store_bench_ssd

crash: install
	$(PY) -m experiments.crash_study

safety: install
	$(PY) -m experiments.safety_study

hitrate: $(XSTAMP)
	$(PY) -m experiments.hitrate_study

replay: install
	$(PY) -m experiments.replay_study

experiments: bench storage store crash safety hitrate replay
	$(MAKE) paper

figures: install
	$(PY) -m experiments.figures

paper: figures
	$(PY) -m experiments.report

clean:
	rm -rf build *.egg-info .pytest_cache
	find quillcache \( -name '_*.c' -o -name '*.so' -o -name '_*.html' \) -delete
	find . -name __pycache__ -prune -exec rm -rf {} +
