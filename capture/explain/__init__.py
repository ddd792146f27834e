"""`tracekit explain`, capture side: rerun each divergent pair under controlled
variants against the live engine, and replay it teacher-forced, writing every
variant as rows of a trace. Naming the cause from those rows is
`tracekit.analyze.explain`'s job; the CLI (`cli/explain.py`) wires the two.

- `plan.plan_targets(A, B, pairs)`: what to replay (prompt, position, tokens,
  boundaries, B's batch mates from its timestamps);
- `variants.run_variants(cfg, targets)`: alone cold, warm at each side's
  boundary, burst with the batch mates, x repeats, on one URL;
- `replay.replay(cfg, targets)`: teacher-forced `full`, `decode`,
  `prefix:<boundary>` per dtype (torch, imported lazily by tracekit.capture.teacher);
- `cache.detect`: how each engine starts cold, or why it cannot.
"""

from __future__ import annotations

from .cache import CacheControl
from .plan import Mate, Target, plan_targets
from .replay import ReplayConfig, replay
from .variants import VariantConfig, VariantSummary, run_variants, tag_of, warm_boundaries

__all__ = [
    "CacheControl",
    "Mate",
    "ReplayConfig",
    "Target",
    "VariantConfig",
    "VariantSummary",
    "plan_targets",
    "replay",
    "run_variants",
    "tag_of",
    "warm_boundaries",
]
