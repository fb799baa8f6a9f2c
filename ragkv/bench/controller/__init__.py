"""`ragkv bench controller`: blend's loading controller (CacheBlend sec. 5.1) against every fixed (r, tier) choice.

One request (real MuSiQue passages, the TTFT benchmark's `build_request`) is cached as blocks in four tiers:
memory, disk, Redis (a private redis-server unless given) and a *throttled* tier, an in-memory tier whose every
layer read waits (`ThrottledStore`: a fixed delay per block and layer, or a bandwidth limit), so that loading
matters on a machine where every real tier is fast next to the model.

- **controller**: the blocks *spread* over the four tiers (some held by two: the controller must pick the faster
  holder), blend with `auto_ratio` (r = max(r_min, the r whose recompute time the loading hides), each block read
  from the tier the load schedule names). The engine's profile (each tier's bandwidth, the model's recompute
  cost) is measured by `engine.profile_store()` before anything is timed.
- **fixed choices**: every r in `ratios` and the controller's own r x every tier forced for *all* blocks. A tier
  is forced honestly by giving each configuration its own single-tier store holding every block (as `ragkv bench
  store` does): the engine can only read from that tier, and the stores' hit counters (column "reads") prove
  which tier was read.
- **spread, fixed r**: the controller's placement with a fixed r (each block from its fastest holder): what the
  controller adds by choosing r.

TTFT is the median of `repeats` round-robin rounds, each starting at another configuration (shared machines
drift alike for every configuration; `full` is timed once, as the reference);
fidelity is the first-token KL(full || x) of `engine.prefill`'s logits. Target: the controller within
10% of the best fixed choice's TTFT among those at equal or better KL. The fixed memory choices hold every block
in memory, so the target says that spreading blocks over slower tiers costs at most 10% once the controller has
chosen r (loading hidden behind the recompute, CacheBlend sec. 5).

The parts: `throttled` (the throttled tier), `config` (the benchmark's and each configuration's settings, the
spread placement), `run` (building the stores, timing, the KL) and `report` (the verdict, the markdown, the plot).
"""

from ragkv.bench.controller.config import ControllerBenchConfig, spread_placement
from ragkv.bench.controller.report import verdict
from ragkv.bench.controller.run import first_token_kl, run_controller_bench
from ragkv.bench.controller.throttled import ThrottledStore

__all__ = ["ControllerBenchConfig", "ThrottledStore", "run_controller_bench", "verdict", "spread_placement",
           "first_token_kl"]
