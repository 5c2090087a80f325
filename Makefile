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

# `make experiments` runs every study's quick profile; `make experiments PROFILE=full` the report's numbers.
PROFILE ?= quick


.PHONY: install etcd-server libgomp test bench storage store crash recovery safety hitrate replay transfer master kvquant gateway cluster experiments figures paper notebook fuzz clean

install: $(STAMP) etcd-server libgomp

# The cluster tests run a real etcd (Debian's etcd-server): installed with apt when root (CI), else they skip saying how.
etcd-server:
	@command -v etcd >/dev/null || { if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server >/dev/null; else echo "etcd not found and not root: the etcd tests will be skipped (apt-get install etcd-server)"; fi; }

# LightGBM (the hit-rate study's learned reuse predictor, which the tests exercise) loads libgomp (Debian's libgomp1).
libgomp:
	@ldconfig -p | grep -q 'libgomp\.so\.1' || { if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libgomp1 >/dev/null; else echo "libgomp1 not found and not root: lightgbm will not import (apt-get install libgomp1)"; fi; }

$(STAMP): setup.py pyproject.toml $(PYX)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -e '.[dev]'
	touch $(STAMP)

# The studies' extra baselines (libCacheSim) on top of the dev install; tests never need them.
$(XSTAMP): $(STAMP)
	$(PIP) install --quiet -e '.[dev,experiments,gateway-baselines]'
	touch $(XSTAMP)

# The suite on TEST_WORKERS processes (pytest-xdist; a file's tests stay on one worker, so its fixtures are
# shared as before), then the tests marked `serial` (timing-sensitive) alone.
TEST_WORKERS ?= 2
test: install
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not serial" --durations=10
	$(PY) -m pytest -q -m serial

# One study (or group) alone, in the profile asked for; `make figures paper` afterwards redraws.
RUN := $(PY) -m experiments --no-report --profile $(PROFILE) --only

bench: install
	$(RUN) microbench_hashing,microbench_alloc,microbench_sketch,microbench_planner

storage: install
	$(RUN) storage

store: install
	$(RUN) store_dram,store_ssd

crash: install
	$(RUN) crash

recovery: install
	$(RUN) recovery

safety: install
	$(RUN) safety

hitrate: $(XSTAMP)
	$(RUN) hitrate

replay: install
	$(RUN) replay

# Our TCP engine vs a raw socket pair and Mooncake's Transfer Engine (prepared on first use in its own
# virtualenv under ~/.cache/quillcache/mooncake: PyPI wheels plus Debian's libibverbs1 when root).
transfer: install
	$(RUN) transfer

# The master's metadata ops/s against Mooncake's master (mooncake_master from the same prepared wheel as
# `make transfer`), restart time at 10k-1M objects, SIGKILLs of the master process, failover through etcd.
master: install
	$(RUN) master

# KV-cache codecs: relMSE / bytes per element against REFERENCE §12's table, a random-weight decoder's
# attention error, the Numba int8 kernels' GB/s against a NumPy copy (GPU rows only where one is lent).
kvquant: install
	$(RUN) kvquant

# The QuillCache gateway vs sglang-router / vllm-router (the gateway-baselines extra), round-robin and direct, in
# front of four stand-in engines (quillcache engine-sim); overhead, hit rate and TTFT per request rate.
gateway: $(XSTAMP)
	$(RUN) gateway

# The pool of real processes (a master + 3 node processes on 127.0.0.1): 100 trials with a node SIGKILLed at a
# seeded point, remote vs local get latency against a raw socket + one master RPC, throughput with 1-3 nodes,
# pooled vs per-node hit rate on the Mooncake conversation trace.
cluster: install
	$(RUN) cluster

experiments: $(XSTAMP)
	$(PY) -m experiments --profile $(PROFILE)

figures: install
	$(PY) -m experiments.figures

paper: figures
	$(PY) -m experiments.report
	$(PY) notebooks/make_notebook.py --execute

# Fuzz every parser of untrusted bytes (WAL, SSD log payloads, trace lines and files, transfer frames, KV events,
# RPC streams) and the SSD tier's recovery from damaged directories with a large Hypothesis budget (minutes).
FUZZ_EXAMPLES ?= 30000
fuzz: install
	HYPOTHESIS_PROFILE=fuzz QUILLCACHE_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest -q tests/fuzz tests/test_store_ssd_damage.py

notebook: install
	$(PY) notebooks/make_notebook.py --execute

clean:
	rm -rf build *.egg-info .pytest_cache
	rm -f $(STAMP) $(XSTAMP)  # the compiled cores go below: the next install must rebuild them
	find quillcache \( -name '_*.c' -o -name '*.so' -o -name '_*.html' \) -delete
	find . -name __pycache__ -prune -exec rm -rf {} +
