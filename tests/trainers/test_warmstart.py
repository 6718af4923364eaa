"""The testbed warm start: reproducible bytes, independent of the caller's threads, built once under a lock."""
import json
import os
import threading

import pytest
import torch

from gradscope.trainers.testbed import cache
from gradscope.trainers.testbed.warmstart import WarmStartConfig

TINY = WarmStartConfig(skill_steps=6, role_steps=6, batch_size=8, hidden=32, layers=1, heads=2, kv_heads=1,
                       intermediate=64)


def test_pinned_scales_and_runs_record_their_build(tmp_path, monkeypatch):
    """Every scale is pinned, and nothing else is (a pin of a config no scale has is stale); a run file records its warm start's digest and whether it is the
    pinned build. Whether this machine builds the pinned bytes depends on its CPU (``cache verify``)."""
    from gradscope.runfile import open_run
    from gradscope.trainers.config import TrainConfig
    from gradscope.trainers.grpo import GRPOConfig
    from gradscope.trainers.testbed.scales import SCALES
    from gradscope.trainers.train import Trainer

    pins = json.loads(cache.PINNED.read_text())
    assert sorted(pin["scale"] for pin in pins.values()) == sorted(SCALES)
    assert all(key == cache.config_id(SCALES[pin["scale"]]) for key, pin in pins.items())
    digest = cache.weights_digest(cache.warm_started_model().state_dict())
    status = "pinned" if digest == cache.pinned_digest(WarmStartConfig()) else "differs from the pin"
    cfg = TrainConfig(steps=1, tasks_per_step=1, n_held_out=2, n_train=4, eval_every=0, checkpoint_every=0,
                      out=str(tmp_path / "run.h5"), grpo=GRPOConfig(group_size=2))
    Trainer(cfg).run()
    with open_run(cfg.out) as run:
        assert run.meta.versions["testbed"] == f"{digest[:16]} ({status})"
    monkeypatch.setattr(cache, "PINNED", tmp_path / "none.json")
    assert cache.provenance(WarmStartConfig()) == f"{digest[:16]} (not pinned)"
    (tmp_path / "other.json").write_text(json.dumps({cache.config_id(WarmStartConfig()): {"digest": "0" * 64}}))
    monkeypatch.setattr(cache, "PINNED", tmp_path / "other.json")
    assert cache.provenance(WarmStartConfig()) == f"{digest[:16]} (differs from the pin)"
    assert cache.main(["verify"]) == 1


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
