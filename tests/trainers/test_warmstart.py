"""The testbed warm start: reproducible bytes, independent of the caller's threads, built once under a lock."""
import os
import threading

import pytest
import torch

from gradscope.trainers.testbed import cache
from gradscope.trainers.testbed.warmstart import WarmStartConfig

TINY = WarmStartConfig(skill_steps=6, role_steps=6, batch_size=8, hidden=32, layers=1, heads=2, kv_heads=1,
                       intermediate=64)


def test_default_build_matches_the_pinned_digest():
    """The suite's warm start (built on this machine unless cached) has the bytes pinned in pinned.json."""
    pinned = cache.pinned_digest(WarmStartConfig())
    assert pinned is not None, "the default warm start has no pinned digest"
    digest = cache.weights_digest(cache.warm_started_model().state_dict())
    assert digest == pinned, ("this machine's warm start differs from the pinned one: its float kernels are not "
                              "the pinned ones, or the warm-start code changed (then re-pin: python -m "
                              "gradscope.trainers.testbed.cache pin)")


def test_build_ignores_the_callers_thread_and_kernel_settings(tmp_path, monkeypatch):
    digests = []
    for i, env in enumerate([{"OMP_NUM_THREADS": "1"},
                             {"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2", "ATEN_CPU_CAPABILITY": "avx512"}]):
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        out = tmp_path / f"w{i}.pt"
        cache._build(TINY, out, verbose=False)
        digests.append(cache.weights_digest(torch.load(out, weights_only=True)))
    assert digests[0] == digests[1]


def test_concurrent_first_runs_build_once(tmp_path, monkeypatch):
    monkeypatch.setenv("GRADSCOPE_CACHE", str(tmp_path))
    builds = []
    real_build = cache._build

    def counted(*args, **kwargs):
        builds.append(threading.get_ident())
        return real_build(*args, **kwargs)

    monkeypatch.setattr(cache, "_build", counted)
    states = []
    workers = [threading.Thread(target=lambda: states.append(cache.warm_started_model(TINY).state_dict()))
               for _ in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert len(builds) == 1 and len(states) == 2
    assert cache.weights_digest(states[0]) == cache.weights_digest(states[1])
    assert [p.name for p in (tmp_path / "testbed").glob("*.tmp*")] == []


def test_a_failed_build_leaves_nothing_behind(tmp_path):
    bad = WarmStartConfig(batch_size=0)  # the child fails on an empty batch
    with pytest.raises(RuntimeError, match="building the testbed warm start failed"):
        cache._build(bad, tmp_path / "w.pt", verbose=False)
    assert os.listdir(tmp_path) == []
