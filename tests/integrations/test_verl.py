"""gradscope.integrations.verl against verl's own FSDP2 actor engine and worker, on CPU.

verl 0.9 has no CPU platform; :func:`cpu_platform` registers one through verl's platform plug-in API
(``PlatformRegistry``), so the real ``FSDPEngineWithLMHead`` (FSDP2, gloo) trains a tiny Qwen3 with
LoRA here. Each case runs under ``torchrun`` (this file is the child script) and saves what it
measured; the tests compare:

* the hooked step's Gram with brute force: one unprobed ``forward_backward_batch`` per agent on the
  batch whose other agents' advantages are 0 (verl's loss then gives exactly that agent's part);
  ``.grad`` after the hooked step with the unprobed gradient; √ΣM with verl's ``grad_norm``;
* 2 processes (each half of the global batch) with 1 process on the same batch;
* the run file rank 0 wrote: agents and roles from the batch's non-tensor fields, one record per
  optimizer step, the per-step update metrics, an alert;
* the worker plug-in: verl's ``ActorRolloutRefWorker`` built from verl's Hydra config
  (``ppo_trainer.yaml``), ``update_actor`` on a multi-agent batch, probed via ``GRADSCOPE_VERL``.

verl is the optional extra ``gradscope[verl]``: without it these tests fail (they do not skip).
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300
AGENTS = ["voter0", "voter1", "voter2", "aggregator"]
ROLES = {"voter0": "voter", "voter1": "voter", "voter2": "voter", "aggregator": "aggregator"}
B, P, R = 8, 5, 6  # rows, prompt and response width of the global batch


# ---------------------------------------------------------------------- the child (under torchrun)
def cpu_platform() -> None:
    """Register and select a CPU platform for verl (its plug-in API); call before verl picks one."""
    from contextlib import contextmanager

    import torch
    from verl.plugin.platform.platform_base import PlatformBase
    from verl.plugin.platform.platform_manager import PlatformRegistry

    class CpuModule:
        """``torch.cpu`` plus the memory queries verl makes of a device module."""

        def __getattr__(self, name):
            return getattr(torch.cpu, name)

        def max_memory_allocated(self, *a, **k): return 0
        def max_memory_reserved(self, *a, **k): return 0
        def memory_allocated(self, *a, **k): return 0
        def memory_reserved(self, *a, **k): return 0
        def mem_get_info(self, *a, **k): return (0, 0)
        def get_device_name(self, *a, **k): return "CPU"
        def empty_cache(self): pass
        def manual_seed(self, seed): torch.manual_seed(seed)
        def manual_seed_all(self, seed): torch.manual_seed(seed)

    @PlatformRegistry.register(platform="cpu")
    class PlatformCPU(PlatformBase):
        device_name = "cpu"
        vendor_name = "cpu"
        device_module = CpuModule()

        def is_available(self): return True
        def current_device(self): return "cpu"  # verl moves modules to get_device_id()
        def device_count(self): return 1
        def set_device(self, i): pass
        def synchronize(self, i=None): pass
        def manual_seed(self, seed): torch.manual_seed(seed)
        def manual_seed_all(self, seed): torch.manual_seed(seed)
        def set_allocator_settings(self, s): pass
        def empty_cache(self): pass
        def get_device_capability(self, i=0): return (None, None)
        def communication_backend_name(self): return "gloo"
        def visible_devices_envvar(self): return "CPU_VISIBLE_DEVICES"
        def profiler_start(self): pass
        def profiler_stop(self): pass
        def ray_resource_name(self): return "CPU"
        def ray_noset_envvars(self): return []
        def is_ipc_supported(self): return False
        def cudart(self): return None

        @contextmanager
        def nvtx_range(self, msg):
            yield

    os.environ["VERL_PLATFORM"] = "cpu"
    os.environ["VERL_ENGINE_DEVICE"] = "cuda"  # the FSDP engines register for cuda/npu; they run on CPU here


def tiny_model(path: Path) -> None:
    """A 2-layer Qwen3 and the testbed tokenizer, saved where verl loads models from (rank 0)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    from gradscope.trainers.testbed.tokenizer import build_tokenizer

    tok = build_tokenizer()
    config = Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tok.save_pretrained(path)


def rollout_batch(rows: slice, seed: int = 1):
    """Rows of a seeded multi-agent batch as verl's trainer hands it to the actor (left-padded prompts,
    right-padded responses, non-tensor ``agent_name`` and ``role``), in verl's no-padding layout."""
    import torch
    from tensordict import TensorDict
    from tensordict.tensorclass import NonTensorData, NonTensorStack
    from verl.workers.utils.padding import left_right_2_no_padding

    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, 40, (B, P), generator=g)
    responses = torch.randint(3, 40, (B, R), generator=g)
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    prompt_mask[0, :2] = prompt_mask[5, :1] = 0
    response_mask = torch.ones(B, R, dtype=torch.long)
    response_mask[1, 4:] = response_mask[6, 2:] = 0
    attention = torch.cat([prompt_mask, response_mask], 1)
    agents = [AGENTS[i % 4] for i in range(B)]
    td = TensorDict({"prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
                     "attention_mask": attention, "position_ids": (attention.cumsum(1) - 1).clamp(min=0),
                     "response_mask": response_mask, "old_log_probs": -3 * torch.rand(B, R, generator=g),
                     "advantages": torch.randn(B, R, generator=g)}, batch_size=[B])
    td["agent_name"] = NonTensorStack.from_list([NonTensorData(a) for a in agents])
    td["role"] = NonTensorStack.from_list([NonTensorData(ROLES[a]) for a in agents])
    return left_right_2_no_padding(td[rows])


def flat_grad(module) -> "torch.Tensor":
    import torch

    parts = []
    for p in module.parameters():
        if p.requires_grad:
            g = torch.zeros_like(p) if p.grad is None else p.grad
            parts.append((g.full_tensor() if hasattr(g, "full_tensor") else g).reshape(-1).double())
    return torch.cat(parts)


def engine_case(out: Path) -> None:
    """One engine, the global batch split over the ranks: brute force (one process), then two hooked
    optimizer steps in one training step, with a run file and an alert."""
    import torch
    import torch.distributed as dist
    from verl.utils import tensordict_utils as tu
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPActorConfig, FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
    from verl.workers.utils.losses import ppo_loss
    from functools import partial

    from gradscope.errors import ConfigError
    from gradscope.integrations.verl import VerlProbe, VerlSettings

    rank, world = dist.get_rank(), dist.get_world_size()
    model = HFModelConfig(path=str(out / "model"), lora_rank=4, lora_alpha=8, target_modules="all-linear",
                          use_remove_padding=False, enable_gradient_checkpointing=True,
                          override_config={"attn_implementation": "eager"})
    engine = FSDPEngineWithLMHead(
        model_config=model, checkpoint_config=CheckpointConfig(),
        engine_config=FSDPEngineConfig(strategy="fsdp2", use_torch_compile=False, micro_batch_size_per_gpu=2,
                                       mixed_precision={"param_dtype": "fp32", "reduce_dtype": "fp32",
                                                        "buffer_dtype": "fp32"}),
        optimizer_config=FSDPOptimizerConfig(lr=1e-3, total_training_steps=10))
    torch.manual_seed(0)  # LoRA initialisation, identical on every rank and in every launch
    engine.initialize()
    loss = partial(ppo_loss, config=FSDPActorConfig(strategy="fsdp2", rollout_n=1, ppo_micro_batch_size_per_gpu=2,
                                                    use_torch_compile=False))
    mine = slice(rank * B // world, (rank + 1) * B // world)

    def batch(seed: int, advantage_of=None):
        td = rollout_batch(mine, seed)
        if advantage_of is not None:  # brute force: only this agent's rows carry loss
            keep = torch.tensor([a == advantage_of for a in list(td["agent_name"])])
            td["advantages"] = td["advantages"] * keep[:, None]
        tu.assign_non_tensor(td, calculate_entropy=False, global_batch_size=B, temperature=1.0,
                             use_remove_padding=False, use_dynamic_bsz=False, micro_batch_size_per_gpu=2,
                             use_fused_kernels=False)
        return td

    saved = {}
    if world == 1:
        with engine.train_mode():
            for k, agent in enumerate(AGENTS):
                engine.optimizer_zero_grad()
                engine.forward_backward_batch(batch(1, agent), loss)
                saved[f"brute/{agent}"] = flat_grad(engine.module).numpy()
        engine.optimizer_zero_grad()
    settings = VerlSettings(run=str(out / "run.h5"), alert=["grad_norm[voter] > 0: record"], default_alerts=False)
    hook = VerlProbe(engine, settings, echo=lambda line: None)
    with hook.training_step():
        with engine.train_mode():
            first = engine.train_batch(batch(1), loss)
            saved["grad_after"] = flat_grad(engine.module).numpy()
            engine.train_batch(batch(2), loss)
    for i, (result, scalars) in enumerate(hook.records):
        saved[f"gram{i}"], saved[f"tokens{i}"], saved[f"method{i}"] = result.gram, result.tokens, np.array(result.method)
        saved[f"scalars{i}"] = np.array([scalars[k] for k in ("loss", "grad_norm", "lr", "samples", "tokens")])
    saved["verl_grad_norm"] = np.array(first["metrics"]["grad_norm"])
    saved["measurement"] = np.array(hook.probe.measurement)
    if world == 1:  # refusals: packed rows (several agents in one row), rows without an agent field
        packed, nameless = batch(1), batch(1)
        tu.assign_non_tensor(packed, use_remove_padding=True)
        del nameless["agent_name"]
        for what, td in (("packed", packed), ("nameless", nameless)):
            try:
                with hook.training_step(), engine.train_mode():
                    engine.train_batch(td, loss)
            except ConfigError as exc:
                saved[f"error/{what}"] = np.array(str(exc))
    hook.close()
    np.savez(out / f"engine{world}_rank{rank}.npz", **saved)


def worker_case(out: Path) -> None:
    """verl's ActorRolloutRefWorker (role "actor") from verl's own Hydra config, probed by the plug-in."""
    import torch
    from hydra import compose, initialize_config_dir
    from verl.utils import tensordict_utils as tu

    os.environ["GRADSCOPE_VERL"] = json.dumps({"run": str(out / "worker.h5"), "default_alerts": False})
    import gradscope.integrations.verl  # noqa: F401 - imported with GRADSCOPE_VERL set: installs itself

    from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker

    assert getattr(TrainingWorker.train_mini_batch, "__gradscope__", False)
    import verl.trainer.config as verl_config

    config_dir = os.path.dirname(verl_config.__file__)
    overrides = [f"actor_rollout_ref.model.path={out / 'model'}", "actor_rollout_ref.model.lora_rank=4",
                 "actor_rollout_ref.model.lora_alpha=8", "actor_rollout_ref.model.target_modules=all-linear",
                 "actor_rollout_ref.model.use_remove_padding=False",
                 "+actor_rollout_ref.model.override_config.attn_implementation=eager",
                 "actor_rollout_ref.actor.strategy=fsdp2", "actor_rollout_ref.actor.use_torch_compile=False",
                 "actor_rollout_ref.actor.fsdp_config.use_torch_compile=False",
                 "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                 "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2", "actor_rollout_ref.rollout.n=1",
                 "+actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp32",
                 "actor_rollout_ref.actor.optim.total_training_steps=10", "trainer.n_gpus_per_node=1"]
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=overrides)
    torch.manual_seed(0)
    worker = ActorRolloutRefWorker(config=cfg.actor_rollout_ref, role="actor")
    worker.init_model()
    td = rollout_batch(slice(0, B))
    tu.assign_non_tensor(td, calculate_entropy=False, global_batch_size=4, mini_batch_size=4, epochs=1, seed=42,
                         dataloader_kwargs={"shuffle": False}, compute_loss=True, temperature=1.0)
    for _ in range(2):
        worker.update_actor(td.clone())
    worker.actor.gradscope.close()
    (out / "worker.done").write_text("ok")


def child_main(case: str, out: str) -> None:
    import torch.distributed as dist

    cpu_platform()
    dist.init_process_group("gloo")
    out_dir = Path(out)
    if dist.get_rank() == 0 and not (out_dir / "model" / "config.json").exists():
        tiny_model(out_dir / "model")
    dist.barrier()
    {"engine": engine_case, "worker": worker_case}[case](out_dir)
    dist.destroy_process_group()


# ---------------------------------------------------------------------- the tests
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(case: str, nproc: int, out: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    env.pop("GRADSCOPE_VERL", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--nnodes=1",
           "--master_addr=127.0.0.1", f"--master_port={_free_port()}", str(Path(__file__)), case, str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.fixture(scope="module")
def engine_runs(tmp_path_factory) -> tuple[Path, Path]:
    one, two = tmp_path_factory.mktemp("one"), tmp_path_factory.mktemp("two")
    _torchrun("engine", 1, one)
    (two / "model").symlink_to(one / "model")
    _torchrun("engine", 2, two)
    return one, two


@pytest.mark.slow
def test_gram_is_the_brute_force_per_agent_gradients(engine_runs):
    one = dict(np.load(engine_runs[0] / "engine1_rank0.npz"))
    G = np.stack([one[f"brute/{a}"] for a in AGENTS])          # (K, P) per-agent gradients, unprobed
    assert _rel(one["gram0"], G @ G.T) < 1e-5
    assert np.abs(G).sum(1).min() > 0                          # every agent had gradient
    np.testing.assert_allclose(one["grad_after"], G.sum(0), rtol=1e-5, atol=1e-9)  # .grad of the probed step
    assert abs(np.sqrt(one["gram0"].sum()) / float(one["verl_grad_norm"]) - 1) < 1e-5
    # response tokens per agent: rows i % 4, each 6 tokens but row 1 (4) and row 6 (2)
    assert one["tokens0"].tolist() == [12, 10, 8, 12]
    assert str(one["measurement"]) == "hooks"
    # the probe's self-check (per-agent autograd at the layers, no row tags) ran on the first step and agreed
    assert [str(one["method0"]), str(one["method1"])] == ["hooks+check", "hooks"]


@pytest.mark.slow
def test_packed_rows_and_rows_without_an_agent_are_refused(engine_runs):
    one = dict(np.load(engine_runs[0] / "engine1_rank0.npz"))
    assert "needs use_remove_padding=False" in str(one["error/packed"])
    assert "no non-tensor field 'agent_name'" in str(one["error/nameless"])


@pytest.mark.slow
def test_two_processes_give_the_one_process_gram(engine_runs):
    one = dict(np.load(engine_runs[0] / "engine1_rank0.npz"))
    for rank in (0, 1):
        two = dict(np.load(engine_runs[1] / f"engine2_rank{rank}.npz"))
        for i in (0, 1):  # both optimizer steps: the second starts from the same updated weights
            assert _rel(two[f"gram{i}"], one[f"gram{i}"]) < 1e-5
            assert two[f"tokens{i}"].tolist() == one[f"tokens{i}"].tolist()
            np.testing.assert_allclose(two[f"scalars{i}"], one[f"scalars{i}"], rtol=1e-5)
            assert str(two[f"method{i}"]) == str(one[f"method{i}"])  # the self-check ran on every rank
        assert str(two["measurement"]) == "hooks+ranks(2)"


@pytest.mark.slow
def test_rank_zero_writes_the_run_file(engine_runs):
    from gradscope.runfile import open_run

    one = dict(np.load(engine_runs[0] / "engine1_rank0.npz"))
    for folder in engine_runs:
        assert sorted(p.name for p in folder.glob("*.h5")) == ["run.h5"]
        with open_run(folder / "run.h5") as run:
            assert run.meta.agents == AGENTS
            assert run.meta.agent_roles == [ROLES[a] for a in AGENTS]
            assert run.meta.policies == ["actor"]
            assert run.step.tolist() == [1, 1] and run.opt_step.tolist() == [0, 1]
            assert list(run.policy) == ["actor", "actor"]
            np.testing.assert_allclose(run.gram[0], one["gram0"], rtol=1e-5)
            np.testing.assert_allclose(run.scalars["grad_norm"][0], float(one["verl_grad_norm"]), rtol=1e-6)
            metrics = run.metrics.set_index("name")["value"]
            assert metrics["opt_steps/actor"] == 2 and metrics["update_norm/actor"] > 0
            assert 0 < metrics["update_rel/actor"] < 1
            assert list(run.events["kind"]) == ["alert"]
            assert "grad_norm[voter]" in run.events["message"][0]


@pytest.mark.slow
def test_worker_plugin_probes_update_actor(tmp_path):
    _torchrun("worker", 1, tmp_path)
    from gradscope.runfile import open_run

    with open_run(tmp_path / "worker.h5") as run:
        assert run.meta.agents == AGENTS and run.meta.agent_roles == [ROLES[a] for a in AGENTS]
        # two update_actor calls, each two mini-batches of 4 rows: one record per optimizer step
        assert run.step.tolist() == [1, 1, 2, 2]
        np.testing.assert_allclose(np.sqrt(run.gram.sum((1, 2))), run.scalars["grad_norm"], rtol=1e-5)
        assert (run.tokens.sum(1) > 0).all()


def test_settings_are_validated():
    from gradscope.errors import ConfigError
    from gradscope.integrations.verl import VerlSettings

    s = VerlSettings.from_mapping({"run": "r.h5", "agents": ["a", "b"], "roles": {"a": "x"}, "sketch": "256",
                                   "default_alerts": "false", "alert": "grad_norm[x] > 1: warn"})
    assert (s.agents, s.roles, s.sketch, s.default_alerts, s.alert) == (["a", "b"], {"a": "x"}, 256, False,
                                                                       ["grad_norm[x] > 1: warn"])
    bad = [({"run": "r.h5", "sketchy": 1}, "unknown gradscope setting(s) ['sketchy']"),
           ({"enabled": True}, "gradscope.run: give the run file"),
           ({"run": "r.h5", "sketch": "many"}, "gradscope.sketch must be an integer"),
           ({"run": "r.h5", "groups": "rows"}, "gradscope.groups must be"),
           ({"run": "r.h5", "agents": ["a", "a"]}, "must be distinct"),
           ({"run": "r.h5", "alert": ["coherence[voter] >"]}, "coherence[voter]")]
    for values, message in bad:
        with pytest.raises(ConfigError, match=None) as err:
            VerlSettings.from_mapping(values)
        assert message in str(err.value) and "\n" not in str(err.value)


def test_launcher_splits_overrides_and_hands_settings_to_ray(tmp_path, monkeypatch):
    from verl.trainer.constants_ppo import PPO_RAY_RUNTIME_ENV

    from gradscope.integrations.verl import PLUGIN, SETTINGS_ENV, VERL_MODULES_ENV, prepare, split_overrides

    argv = [f"gradscope.run={tmp_path}/run.h5", "+gradscope.agents=[voter0,aggregator]",
            "gradscope.roles={voter0:voter,aggregator:aggregator}", "trainer.n_gpus_per_node=8",
            "actor_rollout_ref.model.use_remove_padding=False"]
    values, rest = split_overrides(argv)
    assert values == {"run": f"{tmp_path}/run.h5", "agents": ["voter0", "aggregator"],
                      "roles": {"voter0": "voter", "aggregator": "aggregator"}}
    assert rest == argv[3:]
    env = PPO_RAY_RUNTIME_ENV["env_vars"]
    monkeypatch.setitem(PPO_RAY_RUNTIME_ENV, "env_vars", dict(env))
    monkeypatch.setenv(VERL_MODULES_ENV, "my_plugin")
    settings, rest = prepare(argv)
    forwarded = PPO_RAY_RUNTIME_ENV["env_vars"]
    assert json.loads(forwarded[SETTINGS_ENV])["roles"] == {"voter0": "voter", "aggregator": "aggregator"}
    assert forwarded[VERL_MODULES_ENV] == f"my_plugin,{PLUGIN}"
    assert VERL_MODULES_ENV not in os.environ  # else verl's runtime env would leave it to inheritance
    (tmp_path / "run.h5").write_text("")
    from gradscope.errors import ConfigError

    with pytest.raises(ConfigError, match="already exists"):
        prepare(argv)


def test_launcher_refuses_bad_settings_in_one_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-m", "gradscope.integrations.verl", f"gradscope.run={tmp_path}/r.h5",
                           "gradscope.sketch=-1", "trainer.n_gpus_per_node=1"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "gradscope: error: gradscope.sketch must be >= 0 and gradscope.flush_every >= 1"



def test_launcher_refuses_what_only_a_worker_would_find(tmp_path):
    """A run file in a missing folder (else rank 0's worker fails later), and agents given as a hydra sweep
    (gradscope.agents=voter0,voter1: its message used to print ChoiceSweep's repr), before anything starts."""
    from gradscope.errors import ConfigError
    from gradscope.integrations.verl import prepare

    with pytest.raises(ConfigError) as err:
        prepare([f"gradscope.run={tmp_path}/missing/run.h5"])
    assert str(err.value) == (f"gradscope.run: cannot write {tmp_path}/missing/run.h5: folder {tmp_path}/missing "
                              f"does not exist")
    with pytest.raises(ConfigError) as err:
        prepare([f"gradscope.run={tmp_path}/run.h5", "gradscope.agents=voter0,voter1"])
    assert str(err.value) == ("'gradscope.agents=voter0,voter1' is a hydra sweep (a comma outside brackets); "
                              "give a list: gradscope.agents=[voter0,voter1]")
    with pytest.raises(ConfigError) as err:  # a folder: with overwrite=true, rank 0 alone found out
        prepare([f"gradscope.run={tmp_path}", "gradscope.overwrite=true"])
    assert str(err.value) == f"gradscope.run: {tmp_path} is a folder; give the run file (.h5) to write"


if __name__ == "__main__":
    child_main(sys.argv[1], sys.argv[2])
