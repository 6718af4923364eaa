"""The verl hook's agents and roles (``VerlProbe._build``) on a stand-in engine: no verl needed."""
from __future__ import annotations

import pytest
import torch.nn as nn

import gradscope.integrations.verl as verl_hook
from gradscope.errors import ConfigError
from gradscope.integrations.verl import VerlProbe, VerlSettings


class Engine:
    """What ``VerlProbe`` touches of verl's engine before the first step: one process, a module."""

    def __init__(self) -> None:
        self.module = nn.Sequential(nn.Linear(3, 2))
        self.scaler = None

    def get_data_parallel_size(self) -> int:
        return 1

    def forward_backward_batch(self, *a, **k): ...
    def forward_step(self, *a, **k): ...
    def optimizer_step(self): ...


def build(tmp_path, batch: dict, **settings) -> VerlProbe:
    hook = VerlProbe(Engine(), VerlSettings(run=str(tmp_path / "run.h5"), **settings))
    hook._build(batch)
    return hook


def test_roles_may_name_agents_the_first_update_lacks(tmp_path, monkeypatch):
    """The roles of every agent given up front; the first update has no rows of voter2: the Gram's agents
    are the update's, with the roles given (was: 'rows of agents [voter2] not listed')."""
    monkeypatch.setattr(verl_hook, "_versions", lambda: {"verl": "stand-in"})  # (the run file's metadata)
    roles = {"voter0": "voter", "voter1": "voter", "voter2": "voter", "aggregator": "aggregator"}
    hook = build(tmp_path, {"agent_name": ["voter0", "voter1", "aggregator", "voter0"]}, roles=roles)
    assert hook.probe.agents == ["voter0", "voter1", "aggregator"]
    assert hook.probe.agent_roles == ["voter", "voter", "aggregator"]
    hook.writer.close()


def test_rows_of_an_agent_outside_the_listed_agents_are_an_error(tmp_path):
    with pytest.raises(ConfigError, match=r"rows of agents \['aggregator'\] not listed"):
        build(tmp_path, {"agent_name": ["voter0", "aggregator"]}, agents=["voter0"])


def test_a_role_disagreeing_with_the_batch_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="agent 'voter0' has rows of two roles"):
        build(tmp_path, {"agent_name": ["voter0"], "role": ["voter"]}, roles={"voter0": "critic"})


def test_agents_given_as_one_string_with_commas_are_refused():
    with pytest.raises(ConfigError, match=r"'voter0,voter1' is one name with a comma; give a list, "
                                          r"gradscope.agents=\[voter0,voter1\]"):
        VerlSettings.from_mapping({"run": "run.h5", "agents": "voter0,voter1"})
    assert VerlSettings.from_mapping({"run": "run.h5", "agents": ["voter0", "voter1"]}).agents == ["voter0", "voter1"]


@pytest.mark.parametrize("values, message", [
    ({"policy": ""}, "gradscope.policy must not be empty (default 'actor')"),
    ({"agent_field": ""}, "gradscope.agent_field must not be empty (default 'agent_name')"),
    ({"roles": {"a": {"b": "c"}}}, "gradscope.roles must be a mapping of names to names, got {'a': {'b': 'c'}}"),
    ({"agents": ["a", ["b"]]}, "gradscope.agents must be a list of names, got ['a', ['b']]"),
    ({"policy": "all"}, "gradscope.policy must not be 'all' (analyses name the untagged records' set so)"),
])
def test_settings_that_would_be_stringified_or_empty_are_refused(values, message):
    with pytest.raises(ConfigError) as err:
        VerlSettings.from_mapping({"run": "r.h5", **values})
    assert str(err.value) == message


def test_the_launcher_without_verl_names_the_extra(tmp_path):
    """No verl/hydra (this venv): one line naming the extra, exit 2, not a ModuleNotFoundError."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys; sys.modules.update(dict.fromkeys(['hydra', 'verl'])); "
            "from gradscope.integrations.verl import main; sys.exit(main(sys.argv[1:]))")
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", code, f"gradscope.run={tmp_path}/x.h5"],
                          cwd=Path(__file__).parents[2], capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stderr) == (2, "gradscope: error: the verl launcher needs verl and hydra: "
                                                 "pip install 'gradscope[verl]'\n")


def test_rows_without_an_agent_are_refused(tmp_path):
    """verl's agent loop fills a missing extra field with None: such rows were counted as an agent 'None'."""
    batch = {"agent_name": ["voter0", None, "voter1", "aggregator", float("nan"), "voter1"]}
    with pytest.raises(ConfigError) as err:
        build(tmp_path, batch)
    assert str(err.value) == ("gradscope: 2 of 6 rows have no agent in 'agent_name' (None, empty or NaN); "
                              "every row the actor trains on needs one")
    assert not (tmp_path / "run.h5").exists()


def test_names_with_the_pair_separator_are_refused(tmp_path):
    """Rank 0's run file refused them (ValueError) after the other ranks had moved on: refused with the rows."""
    with pytest.raises(ConfigError, match=r"must not contain '\|': \['v\|0'\]"):
        build(tmp_path, {"agent_name": ["v|0", "v1"]})


def test_agents_are_read_from_the_extra_fields_column(tmp_path, monkeypatch):
    """verl's v1 trainer keeps an agent loop's extra fields as one column of dicts."""
    monkeypatch.setattr(verl_hook, "_versions", lambda: {"verl": "stand-in"})
    extras = [{"agent_name": a, "role": r, "turn_scores": []}
              for a, r in (("voter0", "voter"), ("aggregator", "aggregator"), ("voter1", "voter"))]
    hook = build(tmp_path, {"extra_fields": extras, "uid": ["t0", "t0", "t0"]})
    assert hook.probe.agents == ["voter0", "aggregator", "voter1"]
    assert hook.probe.agent_roles == ["voter", "aggregator", "voter"]
    hook.writer.close()
    with pytest.raises(ConfigError, match="has no non-tensor field 'agent_name'"):
        build(tmp_path, {"extra_fields": [{"turn_scores": []}]}, overwrite=True)


def test_a_rule_naming_a_missing_role_leaves_no_run_file(tmp_path, monkeypatch):
    """Checked on every rank before the run file exists (was: on rank 0 only, after creating the file,
    while the other ranks went on into the step's collectives)."""
    monkeypatch.setattr(verl_hook, "_versions", lambda: {"verl": "stand-in"})
    with pytest.raises(ConfigError, match="unknown role 'nobody'"):
        build(tmp_path, {"agent_name": ["voter0"]}, alert=["coherence[nobody] > 0.5: warn"])
    assert not (tmp_path / "run.h5").exists()


def test_an_agent_first_seen_later_stops_before_the_step(tmp_path, monkeypatch):
    monkeypatch.setattr(verl_hook, "_versions", lambda: {"verl": "stand-in"})
    hook = build(tmp_path, {"agent_name": ["voter0", "voter1"]})
    assert hook._unknown_agents({"agent_name": ["voter1", "voter0"]}) is None
    with pytest.raises(ConfigError) as err:
        hook._agree(hook._unknown_agents({"agent_name": ["voter0", "aggregator"]}))
    assert str(err.value) == ("gradscope: rows of agents ['aggregator'] first seen after the first update; the "
                              "Gram's agents are ['voter0', 'voter1'] (list every agent in gradscope.agents)")
    hook.writer.close()


def test_settings_built_in_python_are_checked_as_the_config_is(tmp_path):
    with pytest.raises(ConfigError, match="'voter0,voter1' is one name with a comma"):
        VerlProbe(Engine(), VerlSettings(run=str(tmp_path / "run.h5"), agents="voter0,voter1"))


def test_settings_handed_to_workers_need_an_absolute_run_path(monkeypatch):
    monkeypatch.setenv(verl_hook.SETTINGS_ENV, '{"run": "runs/run.h5"}')
    with pytest.raises(ConfigError) as err:
        verl_hook.settings_from_env()
    assert str(err.value) == "GRADSCOPE_VERL: gradscope.run must be an absolute path, got 'runs/run.h5'"


def _rank(rank: int, init: str, run: str, queue, case: str) -> None:
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    try:
        agents, settings = ["voter0", "voter1"], VerlSettings(run=run)
        if case == "rows" and rank == 1:
            agents = ["voter0", None]
        if case == "alerts":  # the alerts file is on rank 0's node only
            settings.alerts = run + (".alerts.yaml" if rank == 0 else ".missing.yaml")
        VerlProbe(Engine(), settings)._build({"agent_name": agents})
        queue.put((rank, "built"))
    except ConfigError as exc:
        queue.put((rank, str(exc)))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("case", ["rows", "alerts"])
def test_an_error_on_one_rank_stops_every_rank(tmp_path, case):
    """Rank 1's rows lack an agent, or its node lacks the alerts file; rank 0 is fine: both raise the same
    one-line error, and no run file is made (was: rank 1 raised while rank 0 waited in the collective until
    its timeout)."""
    import multiprocessing as mp

    run = tmp_path / "run.h5"
    (tmp_path / "run.h5.alerts.yaml").write_text("- 'grad_norm[voter0] > 100: warn'\n")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    init = f"file://{tmp_path}/store"
    procs = [ctx.Process(target=_rank, args=(r, init, str(run), queue, case)) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    outcome = dict(queue.get(timeout=5) for _ in procs)
    message = {"rows": "gradscope: 1 of 2 rows have no agent in 'agent_name' (None, empty or NaN); every row the "
                       "actor trains on needs one",
               "alerts": f"cannot read alert file {run}.missing.yaml: No such file or directory"}[case]
    assert outcome[0] == outcome[1] and outcome[0].startswith(message), outcome
    assert not run.exists()
