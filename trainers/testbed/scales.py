"""The testbed scales (``--scale``): one warm-start config per model size.

Named by their parameter count and standing in for the paper's Qwen3 0.6B / 1.7B / 4B: the same
warm-start recipe (:class:`WarmStartConfig`), wider and deeper models, head width 32–64. Each scale
has its own cached warm start with its digest pinned in ``pinned.json``.

| scale | hidden | layers | heads (kv) | MLP | parameters |
|---|---|---|---|---|---|
| 0.3M | 128 | 2 | 4 (2) | 256 | 308,480 |
| 1.5M | 192 | 4 | 4 (2) | 512 | 1,643,328 |
| 6M | 384 | 4 | 6 (2) | 1024 | 6,333,824 |
"""
from __future__ import annotations

from gradscope.trainers.testbed.warmstart import WarmStartConfig

SCALES: dict[str, WarmStartConfig] = {
    "0.3M": WarmStartConfig(),
    "1.5M": WarmStartConfig(hidden=192, layers=4, heads=4, kv_heads=2, intermediate=512),
    "6M": WarmStartConfig(hidden=384, layers=4, heads=6, kv_heads=2, intermediate=1024),
}
DEFAULT_SCALE = "0.3M"
