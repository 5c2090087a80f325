"""The registry of studies: what ``make experiments`` runs, ``make figures`` draws and
``make paper`` reports, in that order.

Each study is a module with ``run(quick=False, results_root=None)`` (writes
``results/<name>/``, ``profile`` quick or full) and ``plot(results_root=None,
out_dir="paper/figures")`` (reads only ``results/``; returns the figure path or paths), and a
report section template ``paper/templates/sections/<name>.md.j2``. A new study (transfer,
master, cluster, gateway, quantization) registers here and adds its template and a notebook cell.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

from quillcache.registry import Registry


@dataclass(frozen=True, kw_only=True)
class Study:
    name: str            # results/<name>/ and the report section
    module: str          # dotted module with run() and plot()
    title: str           # the report's section heading
    make_target: str     # the make target that runs it alone
    needs_extra: bool = False  # True: run after `make` installed the experiments extra

    def load(self) -> ModuleType:
        return importlib.import_module(self.module)


STUDIES: Registry[Study] = Registry("study")
for _s in (
    Study(name="microbench_hashing", module="experiments.microbench.bench_hashing", title="Block hashing",
          make_target="bench"),
    Study(name="microbench_alloc", module="experiments.microbench.bench_alloc", title="Offset allocator",
          make_target="bench"),
    Study(name="microbench_sketch", module="experiments.microbench.bench_sketch", title="Count-min sketch",
          make_target="bench"),
    Study(name="microbench_planner", module="experiments.microbench.bench_planner", title="Planner throughput",
          make_target="bench"),
    Study(name="storage", module="experiments.storage_study", title="Residency index storage",
          make_target="storage"),
    Study(name="store_dram", module="experiments.store_bench_dram", title="DRAM tier throughput",
          make_target="store"),
    Study(name="store_ssd", module="experiments.store_bench_ssd", title="SSD tier throughput", make_target="store"),
    Study(name="crash", module="experiments.crash_study", title="Crash consistency", make_target="crash"),
    Study(name="recovery", module="experiments.recovery_bench", title="Recovery time under damage",
          make_target="recovery"),
    Study(name="safety", module="experiments.safety_study", title="Identity-guard safety", make_target="safety"),
    Study(name="hitrate", module="experiments.hitrate_study", title="Hit rate and the offline bound",
          make_target="hitrate", needs_extra=True),
    Study(name="replay", module="experiments.replay_study", title="Routers on the trace replay",
          make_target="replay"),
    Study(name="transfer", module="experiments.transfer_study", title="Transfer engine over TCP",
          make_target="transfer"),
    Study(name="master", module="experiments.master_study", title="Master service: metadata throughput, restarts, kills",
          make_target="master"),
    Study(name="kvquant", module="experiments.kvquant_study", title="KV-cache quantization: error, size, kernel throughput",
          make_target="kvquant"),
    Study(name="gateway", module="experiments.gateway_study",
          title="OpenAI-compatible gateway: overhead, prefix-cache hit rate and TTFT against sglang-router",
          make_target="gateway"),
    Study(name="cluster", module="experiments.cluster_study",
          title="A pool of real processes: failures, get latency, throughput, pooled vs per-node hit rate",
          make_target="cluster"),
):
    STUDIES.register(_s.name, _s)
