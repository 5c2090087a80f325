# QuillCache — one target per step: install → test / bench / experiments → figures → paper.
# `clean` removes build artefacts only; results/ is never deleted by any target.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.installed
PYX    := $(wildcard quillcache/_fast/*.pyx quillcache/_fast/*.pxd)

export PYTHONFAULTHANDLER := 1

.PHONY: install test bench storage store crash safety experiments figures paper clean

install: $(STAMP)

$(STAMP): setup.py pyproject.toml $(PYX)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -e '.[dev]'
	touch $(STAMP)

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

experiments: bench storage store crash safety
	$(MAKE) paper

figures: install
	$(PY) -m experiments.figures

paper: figures
	$(PY) -m experiments.report

clean:
	rm -rf build *.egg-info quillcache/_fast/*.c quillcache/_fast/*.so quillcache/_fast/*.html .pytest_cache
	find . -name __pycache__ -prune -exec rm -rf {} +
