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
