"""The testbed scales (``--scale``): one warm-start config per model size.

Named by their parameter count and standing in for the paper's Qwen3 0.6B / 1.7B / 4B: the same
warm-start recipe (:class:`WarmStartConfig`) but for the 4-layer scales' longer first phase
(:data:`SKILL_STEPS_DEEP`), wider and deeper models, head width 32–64. Each scale
has its own cached warm start with its digest pinned in ``pinned.json``.

| scale | hidden | layers | heads (kv) | MLP | parameters |
|---|---|---|---|---|---|
| 0.3M | 128 | 2 | 4 (2) | 256 | 308,480 |
| 1.5M | 192 | 4 | 4 (2) | 512 | 1,643,328 |
| 6M | 384 | 4 | 6 (2) | 1024 | 6,333,824 |
"""
from __future__ import annotations

from gradscope.trainers.testbed.warmstart import WarmStartConfig

#: Phase-1 steps of the 4-layer scales: they go through the arithmetic transition later than 0.3M's
#: 2 layers (greedy solver accuracy on held-out math, 1.5M: 0.12 after 400 steps, 0.49 after 700, 0.93
#: after 1000; 0.3M: 0.77 after 400; docs/training.md, "Scales"), and with 400 steps, as at 0.3M, the
#: 1.5M warm start stayed weak.
SKILL_STEPS_DEEP = 1200

SCALES: dict[str, WarmStartConfig] = {
    "0.3M": WarmStartConfig(),
    "1.5M": WarmStartConfig(hidden=192, layers=4, heads=4, kv_heads=2, intermediate=512, skill_steps=SKILL_STEPS_DEEP),
    "6M": WarmStartConfig(hidden=384, layers=4, heads=6, kv_heads=2, intermediate=1024, skill_steps=SKILL_STEPS_DEEP),
}
DEFAULT_SCALE = "0.3M"
