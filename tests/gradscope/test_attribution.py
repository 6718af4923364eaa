"""Which row is whose: explicit row tags, the batch dimension of each layer, the self-check against
split, per-row and scalar losses, and the method each record says measured it."""
from __future__ import annotations

import warnings
from contextlib import nullcontext

import numpy as np
import pytest
import torch
import torch.nn as nn

from gradscope.errors import ProbeError
from gradscope.probe import Probe
from tests.gradscope.test_hooks import LMCase, brute, lora_model, lora_params, run
from tests.gradscope.test_probe import AGENTS, ROLES, brute_force_gram, rel_err

ROW_AGENT = torch.tensor([0, 1, 2, 3])


# ---------------------------------------------------------------- sequence-first inputs
def seq_first_case(T: int, B: int = 4):
    """A sequence-first encoder layer (input (T, B, d)); its feed-forward Linears are probed."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=False).double()
    params = [(n, p) for n, p in layer.named_parameters() if n.startswith("linear")]
    for n, p in layer.named_parameters():
        p.requires_grad_(n.startswith("linear"))
    x = torch.randn(T, B, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    adv = torch.tensor([1.0, -0.5, 0.8, 0.3], dtype=torch.float64)[:B, None]

    def forward():
        out = layer(x)                                  # (T, B, 8)
        return adv * out.square().sum(-1).T / 10        # (B, T) per-token loss of row b
    agent_ids = ROW_AGENT[:B, None].expand(B, T)
    loss = forward()
    terms = {a: loss[agent_ids == k].sum() for k, a in enumerate(AGENTS)}
    return layer, params, forward, agent_ids, brute_force_gram(terms, [p for _, p in params])


def probed_step(layer, params, forward, agent_ids, tag=None, **kw):
    layer.zero_grad(set_to_none=True)
    probe = Probe(layer, AGENTS, ROLES, params=params, **kw)
    try:
        with probe.step(0) as s:
            if tag is None:
                loss = forward()
            else:
                with s.rows(agent_ids[:, 0], batch_dim=tag):
                    loss = forward()
            s.backward_tokens(loss, agent_ids)
    finally:
        probe.close()
    return s.result


def test_seq_first_with_t_equal_b_is_caught_by_the_self_check():
    """T == B: dimension 0 (time) has the batch size too. auto: the self-check finds the wrong attribution,
    the record takes split's (right) Gram and says so; hooks: a clear error naming the layer and the cause."""
    layer, params, forward, agent_ids, expected = seq_first_case(T=4)
    with pytest.warns(RuntimeWarning, match="sequence-first"):
        auto = probed_step(layer, params, forward, agent_ids)
    assert auto.method == "split-fallback:check-failed" and rel_err(auto.gram, expected) < 1e-10
    assert any("linear" in w and "batch_dim" in w for w in auto.warnings)
    with pytest.raises(ProbeError, match=r"layer 'linear[12]'.*batch_dim"):
        probed_step(layer, params, forward, agent_ids, method="hooks")


@pytest.mark.parametrize("method", ["hooks", "auto"])
def test_seq_first_with_t_equal_b_and_no_check_falls_back_to_split(method):
    """T == B on a step no self-check measures: hooks cannot tell the batch dimension, so the call goes
    through split (right Gram), and the record and the warning name the layer and batch_dim."""
    layer, params, forward, agent_ids, expected = seq_first_case(T=4)
    with pytest.warns(RuntimeWarning, match=r"layer 'linear1': several dimensions of its input, \[0, 1\], have size B = 4"):
        result = probed_step(layer, params, forward, agent_ids, method=method, check_every=None)
    assert result.method == "split-fallback:unmatched-rows"
    assert any("batch_dim" in w for w in result.warnings)
    assert rel_err(result.gram, expected) < 1e-10


def seq_first_step(probe, layer, params, step: int, T: int, agents) -> str:
    """One probed step of :func:`seq_first_case`'s layer on 4 rows of T tokens (row b: ``agents[b]``): its
    Gram checked against brute force; returns the record's method."""
    x = torch.randn(T, 4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
    adv = torch.tensor([1.0, -0.5, 0.8, 0.3], dtype=torch.float64)[:, None]
    ids = torch.as_tensor(agents)[:, None].expand(4, T)

    def forward():
        return adv * layer(x).square().sum(-1).T / 10  # (B, T)
    expected = brute_force_gram({a: forward()[ids == k].sum() for k, a in enumerate(AGENTS)}, [p for _, p in params])
    layer.zero_grad(set_to_none=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with probe.step(step) as s:
            s.backward_tokens(forward(), ids)
    assert rel_err(s.result.gram, expected) < 1e-10
    return s.result.method


def test_the_dimension_the_first_check_confirmed_holds_at_later_steps():
    """Sequence-first (T, B, d), T != B: the only dimension of size B is not the leading one, a guess, which
    the default check (the first step) confirms; later steps with T == B (varying sequence lengths) or
    T != B use the confirmed dimension: hooks, the right Gram."""
    layer, params, _, _, _ = seq_first_case(T=5)
    probe = Probe(layer, AGENTS, ROLES, params=params, method="hooks")
    try:
        seen = [seq_first_step(probe, layer, params, step, T, ROW_AGENT) for step, T in enumerate((5, 4, 6))]
    finally:
        probe.close()
    assert seen == ["hooks+check", "hooks", "hooks"] and probe.state_dict()["state"]["batch_dims"] == {"linear1": 1, "linear2": 1}


@pytest.mark.parametrize("T,tag", [(4, 1), (5, None), (5, 1)])
def test_seq_first_is_attributed_by_its_batch_dimension(T, tag):
    """Declared (batch_dim=1), or the only dimension of size B: hooks gets it right, and the check agrees."""
    layer, params, forward, agent_ids, expected = seq_first_case(T=T)
    result = probed_step(layer, params, forward, agent_ids, tag=tag, method="hooks")
    assert result.method == "hooks+check" and not result.warnings
    assert rel_err(result.gram, expected) < 1e-10


class Chunked(nn.Module):
    """Works through the batch in chunks of 4 rows (a memory-saving pattern): a chunk's layer input is
    (4, T, d), so with B = 8 and T == 8 its only dimension of size B is the sequence axis."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second = nn.Linear(6, 16).double(), nn.Linear(16, 3).double()

    def forward(self, x):                                   # (B, T, 6)
        return torch.cat([self.second(torch.tanh(self.first(c))) for c in x.split(4)])


def chunked_step(probe, model, B, T, step):
    """One probed step of :class:`Chunked` on B rows of T tokens, rows alternating between two agents;
    its result and the brute-force Gram."""
    x = torch.randn(B, T, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
    ids = torch.arange(B)[:, None].expand(B, T) % 2

    def loss():
        return model(x).square().sum(-1) / 10              # (B, T) per-token loss
    expected = brute_force_gram({a: loss()[ids == k].sum() for k, a in enumerate(AGENTS)}, list(model.parameters()))
    model.zero_grad(set_to_none=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with probe.step(step) as s:
            s.backward_tokens(loss(), ids)
    return s.result, expected, [str(w.message) for w in caught]


@pytest.mark.parametrize("method", ["hooks", "auto"])
def test_the_sequence_axis_of_a_chunk_is_not_taken_for_the_batch(method):
    """A forward in chunks of 4 rows: at B = 4 (one chunk) hooks attributes it and the check passes; at
    B = 8, T = 8 each chunk's only dimension of size B is its sequence axis: a guess no check confirms
    at that step, so the call goes through split (right Gram, the warning naming the layer and why)
    instead of giving token t's gradient to row t's agent (19 % error before)."""
    model = Chunked()
    probe = Probe(model, AGENTS, ROLES, method=method)
    try:
        first, expected, _ = chunked_step(probe, model, B=4, T=5, step=0)
        assert first.method == "hooks+check" and rel_err(first.gram, expected) < 1e-10
        later, expected, caught = chunked_step(probe, model, B=8, T=8, step=1)
    finally:
        probe.close()
    assert later.method == "split-fallback:unmatched-rows" and rel_err(later.gram, expected) < 1e-10
    assert any("layer 'first': the only dimension of its input of size B = 8 is dimension 1, not the leading one"
               in w for w in caught), caught


@pytest.mark.parametrize("method", ["hooks", "auto"])
def test_a_check_on_rows_of_one_agent_confirms_no_batch_dimension(method):
    """Sequence-first with T == B, first step: every row one agent's, so any dimension attributes alike and
    the passed check proves nothing about the batch dimension: it fixes none (it fixed the wrong one
    before, and the next step with two agents was 62 % off, unwarned). That next step's guess goes
    through split and re-arms the check, which the step after (T != B) passes, fixing the dimension:
    hooks from then on, at T == B too."""
    layer, params, _, _, _ = seq_first_case(T=4)
    probe = Probe(layer, AGENTS, ROLES, params=params, method=method)
    seen, fixed = [], []
    try:
        for step, (T, agents) in enumerate(((4, [0, 0, 0, 0]), (4, [0, 1, 0, 1]), (5, [0, 1, 0, 1]),
                                            (4, [1, 0, 1, 0]))):
            seen.append(seq_first_step(probe, layer, params, step, T, agents))
            fixed.append(probe.state_dict()["state"]["batch_dims"])
    finally:
        probe.close()
    assert seen == ["hooks+check", "split-fallback:unmatched-rows", "hooks+check", "hooks"]
    assert fixed[:2] == [{}, {}] and fixed[3] == {"linear1": 1, "linear2": 1}


# ---------------------------------------------------------------- several forwards, any order
@pytest.mark.parametrize("reverse", [False, True])
def test_tagged_forwards_match_rows_whatever_the_concatenation_order(reverse):
    """One forward per role (IP), the roles' losses concatenated in call order or reversed: with row tags
    hooks attributes every row right, with no fallback."""
    model = lora_model("ip", torch.float32)
    case = LMCase(model, "ip")
    call = case.call(list(range(8)), reverse=reverse)
    expected = brute([call], lora_params(model))
    result, probe = run(model, "hooks", [call])
    assert probe._method.fallback_calls == 0 and result.method == "hooks+check"
    assert rel_err(result.gram, expected) < 1e-5


def test_untagged_forwards_fall_back_naming_the_cause():
    """Two untagged forwards, losses in reverse order: hooks cannot know which rows are whose without
    trusting call order; the call goes through split (right Gram) and the record and warning say why."""
    model = lora_model("ip", torch.float32)
    case = LMCase(model, "ip")
    tagged = case.call(list(range(8)), reverse=True)

    def untagged():
        return tagged(None)
    expected = brute([tagged], lora_params(model))
    with pytest.warns(RuntimeWarning, match="without row tags"):
        result, probe = run(model, "auto", [untagged])
    assert result.method == "split-fallback:untagged-forwards" and probe._method.fallback_calls == 1
    assert any("s.rows" in w for w in result.warnings)
    assert rel_err(result.gram, expected) < 1e-5


def test_an_unowned_row_with_wrong_tags_is_blamed_on_the_tags():
    """Forwards tagged in the wrong order, one row of no agent: its loss lands on a row tagged -1. The
    error names the tags, not 'a weight used outside its layer'."""
    model = lora_model("ip", torch.float32)
    case = LMCase(model, "ip")
    case.agent_ids[7] = -1  # the second aggregator row has no agent
    rows = list(range(8))

    def call(s):  # voters then aggregator, but the tags say aggregator rows first
        voters, aggs = rows[:6], rows[6:]
        tags = [case.ROW_AGENT[aggs].clone(), case.ROW_AGENT[voters]]
        tags[0][1] = -1
        parts = []
        for part, tag in ((voters, tags[1].flip(0)), (aggs, tags[0].flip(0))):
            with s.rows(tag):
                parts.append(case.logprobs(part))
        lp = torch.cat(parts)
        ids = case.agent_ids[rows]
        return -case.adv[rows] * lp * (ids >= 0) / case.n_total, ids
    call.tags = True
    with pytest.raises(ProbeError, match="rows tagged with no agent .* tags do not match"):
        run(model, "hooks", [call], check_every=None)


# ---------------------------------------------------------------- the self-check
class RowMixer(nn.Module):
    """Two Linears; the second sees the batch rows rolled by one: its rows are not the loss's rows."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second = nn.Linear(6, 6).double(), nn.Linear(6, 3).double()

    def forward(self, x):
        h = torch.tanh(self.first(x))
        return self.second(h.roll(1, dims=0)).roll(-1, dims=0)


def test_self_check_catches_a_misattributed_layer_and_names_it():
    model = RowMixer()
    x = torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    ids = ROW_AGENT[:, None]

    def loss():
        return model(x).square().sum(1, keepdim=True) * torch.tensor([[1.0], [-2.0], [0.5], [1.5]], dtype=torch.float64)
    terms = {a: loss()[ids == k].sum() for k, a in enumerate(AGENTS)}
    expected = brute_force_gram(terms, list(model.parameters()))
    probe = Probe(model, AGENTS, ROLES, method="hooks")
    with pytest.raises(ProbeError, match="self-check.*layer 'second'"):
        with probe.step(0) as s:
            s.backward_tokens(loss(), ids)
    probe = Probe(model, AGENTS, ROLES)  # auto: split's Gram for this record and every later one
    methods = []
    for step in range(2):
        model.zero_grad(set_to_none=True)
        with pytest.warns(RuntimeWarning) if step == 0 else _no_warning(), probe.step(step) as s:
            s.backward_tokens(loss(), ids)
        methods.append(s.result.method)
        assert rel_err(s.result.gram, expected) < 1e-10
    assert methods == ["split-fallback:check-failed"] * 2


def test_after_a_failed_check_hooks_raises_at_every_later_step():
    """method="hooks" does not fall back: once its check failed, a loop that catches the error and goes on
    gets the error again at every later step, not unchecked hooks Grams (86 % off before), also in a probe
    restored from the failed one's state."""
    model = RowMixer()
    x = torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    ids = ROW_AGENT[:, None]
    probe = Probe(model, AGENTS, ROLES, method="hooks")
    for step in range(3):
        model.zero_grad(set_to_none=True)
        with pytest.raises(ProbeError, match="self-check.*layer 'second'" + (".*at an earlier step" if step else "")):
            with probe.step(step) as s:
                s.backward_tokens(model(x).square().sum(1, keepdim=True), ids)
        assert not probe._method._forwards  # a caught error keeps no step's graph alive
    model.zero_grad(set_to_none=True)
    with pytest.raises(ProbeError, match="self-check.*at an earlier step"):  # per-agent losses too (they went to split)
        with probe.step(3) as s:
            out = model(x).square().sum(1)
            s.backward({a: out[k] for k, a in enumerate(AGENTS)})
    state = probe.state_dict()
    assert state["state"]["failed_check"] is True
    probe.close()
    restored = Probe(model, AGENTS, ROLES, method="hooks")
    restored.load_state_dict(state)
    with pytest.raises(ProbeError, match="self-check.*at an earlier step"):
        with restored.step(3) as s:
            s.backward_tokens(model(x).square().sum(1, keepdim=True), ids)
    restored.close()


class BatchCentred(nn.Module):
    """A term across the batch (BatchNorm's mean): a row's gradient carries the other rows' losses."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second = nn.Linear(5, 6).double(), nn.Linear(6, 3).double()

    def forward(self, x):
        h = self.first(x)
        return self.second(torch.tanh(h - h.mean(0, keepdim=True)))


def test_a_failed_check_is_remembered_when_the_add_up_check_fails_too():
    """A step whose row of no agent receives gradient (the add-up error) and whose check fails: the error is the
    check's (it names the layer and the cause), and hooks must remember the failed check, or the next steps ran
    unchecked (37 % and 14 % off)."""
    model = BatchCentred()
    probe = Probe(model, AGENTS, ROLES, method="hooks")
    for step, agents in enumerate(([0, 1, 2, -1], [0, 1, 2, 0], [2, 1, 0, 1])):
        agents = torch.tensor(agents)
        x = torch.randn(4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
        model.zero_grad(set_to_none=True)
        with pytest.raises(ProbeError, match="self-check: .*layer 'first'.*mixes rows" if step == 0 else "at an earlier step"):
            with probe.step(step) as s:
                s.backward_rows(model(x).square().sum(1) * (agents >= 0), agents)
    probe.close()


@pytest.mark.parametrize("wrong", ["loss-rows-reversed", "tags-reversed"])
def test_self_check_catches_rows_in_another_order_than_the_forward(wrong):
    """The loss's rows in another order than the forward's (an untagged forward takes its rows' agents from
    the loss), or row tags in the wrong order: hooks would silently give rows to the wrong agents. The
    self-check (no row information) catches it: auto takes its (right) Gram, hooks raises."""
    model = lora_model("sp", torch.float64)
    case = LMCase(model, "sp")
    rows = list(range(8))
    expected = brute([case.call(rows)], lora_params(model))
    order = rows[::-1]

    def call(s):
        if wrong == "loss-rows-reversed":
            lp = case.logprobs(rows)[order]
            ids = case.agent_ids[order]
            return -case.adv[order] * lp * (ids >= 0) / case.n_total, ids
        with s.rows(case.ROW_AGENT[order]):
            lp = case.logprobs(rows)
        ids = case.agent_ids[rows]
        return -case.adv[rows] * lp * (ids >= 0) / case.n_total, ids
    call.tags = True
    with pytest.warns(RuntimeWarning, match="self-check"):
        result, _ = run(model, "auto", [call])
    assert result.method == "split-fallback:check-failed" and rel_err(result.gram, expected) < 1e-10
    with pytest.raises(ProbeError, match="self-check.*row tags"):
        run(model, "hooks", [call])


class LeakyRowMixer(RowMixer):
    """RowMixer whose second weight is also used outside its layer: invisible to hooks and to the check."""

    def forward(self, x):
        return super().forward(x) + torch.nn.functional.linear(x, self.second.weight)


def test_a_failed_check_still_catches_a_weight_used_outside_its_layer():
    """The self-check differentiates at the hooked layers' outputs, so its Gram misses a use of the weight
    outside the layer too: after a failed check (auto) the add-up check still runs, on the check's Gram."""
    model = LeakyRowMixer()
    x = torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    probe = Probe(model, AGENTS, ROLES)
    with pytest.raises(ProbeError, match="do not add up"), pytest.warns(RuntimeWarning, match="self-check"):
        with probe.step(0) as s:
            s.backward_tokens(model(x).square().sum(1, keepdim=True), ROW_AGENT[:, None])


class _no_warning:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_check_schedule():
    """check_every: 0 → the first checkable step only; 2 → every second probed step; None → never. A step
    with only a scalar loss cannot be checked, and one with only per-agent losses (split) or no call
    has nothing hooks attributed to check: the check waits for the next step."""
    model = lora_model("sp", torch.float32)
    case = LMCase(model, "sp")
    call = case.call(list(range(8)))

    def methods(check_every, first="tokens"):
        probe = Probe(model, AGENTS, ROLES, check_every=check_every)
        out = []
        for step in range(4):
            model.zero_grad(set_to_none=True)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # (per-agent losses: the fallback's warning)
                with probe.step(step) as s:
                    loss, ids = call(s)
                    if step == 0 and first == "none":
                        pass  # a forward, no backward
                    elif step == 0 and first == "scalar":
                        s.backward_rows(loss.sum(), ids.max(1).values)
                    elif step == 0 and first == "per-agent":
                        s.backward({a: loss[ids == k].sum() for k, a in enumerate(AGENTS)})
                    else:
                        s.backward_tokens(loss, ids)
            out.append(s.result.method)
        probe.close()
        return out
    assert methods(0) == ["hooks+check", "hooks", "hooks", "hooks"]
    assert methods(2) == ["hooks+check", "hooks", "hooks+check", "hooks"]
    assert methods(None) == ["hooks"] * 4
    assert methods(0, first="scalar") == ["hooks", "hooks+check", "hooks", "hooks"]
    assert methods(0, first="per-agent") == ["split-fallback:per-agent-losses", "hooks+check", "hooks", "hooks"]
    assert methods(0, first="none") == ["hooks", "hooks+check", "hooks", "hooks"]


def test_probe_state_continues_the_check_schedule_and_its_outcome():
    """A probe restored from another's state_dict (a resumed trainer's) records what the saved probe
    would have: the check schedule continues (a fresh probe would check at once), a failed check
    keeps split."""
    model = lora_model("sp", torch.float32)
    call = LMCase(model, "sp").call(list(range(8)))

    def methods(probe, steps):
        out = []
        for step in steps:
            model.zero_grad(set_to_none=True)
            with probe.step(step) as s:
                loss, ids = call(s)
                s.backward_tokens(loss, ids)
            out.append(s.result.method)
        probe.close()
        return out
    first = Probe(model, AGENTS, ROLES, check_every=3)
    assert methods(first, [0, 1]) == ["hooks+check", "hooks"]
    resumed = Probe(model, AGENTS, ROLES, check_every=3)
    resumed.load_state_dict(first.state_dict())
    assert methods(resumed, [2, 3, 4]) == ["hooks", "hooks+check", "hooks"]
    assert methods(Probe(model, AGENTS, ROLES, check_every=3), [2, 3, 4]) == ["hooks+check", "hooks", "hooks"]

    layer, params, forward, agent_ids, expected = seq_first_case(T=4)
    failed = Probe(layer, AGENTS, ROLES, params=params)
    with pytest.warns(RuntimeWarning, match="sequence-first"), failed.step(0) as s:
        s.backward_tokens(forward(), agent_ids)
    assert s.result.method == "split-fallback:check-failed"
    again = Probe(layer, AGENTS, ROLES, params=params)
    again.load_state_dict(failed.state_dict())
    layer.zero_grad(set_to_none=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no check again (a fresh probe's would fail and warn)
        with again.step(1) as s:
            s.backward_tokens(forward(), agent_ids)
    assert s.result.method == "split-fallback:check-failed" and not s.result.warnings
    assert rel_err(s.result.gram, expected) < 1e-10
    with pytest.raises(ProbeError, match="of method 'hooks'"):
        Probe(layer, AGENTS, ROLES, params=params, method="split").load_state_dict(failed.state_dict())
    failed.close(), again.close()


# ---------------------------------------------------------------- per-row and scalar losses
@pytest.mark.parametrize("method", ["hooks", "split"])
def test_backward_rows_per_row_losses(method):
    model = lora_model("sp", torch.float32)
    case = LMCase(model, "sp")
    call = case.call(list(range(8)))
    expected = brute([call], lora_params(model))
    model.zero_grad(set_to_none=True)
    probe = Probe(model, AGENTS, ROLES, method=method)
    with probe.step(0) as s:
        token_loss, ids = call(s)
        row_agent = ids.max(1).values
        s.backward_rows(token_loss.sum(1), row_agent, tokens=(ids >= 0).sum(1))
    assert rel_err(s.result.gram, expected) < 1e-5
    assert s.result.tokens.tolist() == [int((case.agent_ids == k).sum()) for k in range(4)]
    assert s.result.method == ("hooks+check" if method == "hooks" else "split")


def test_scalar_loss_with_row_agents():
    """A framework's loss (a mean over rows) with the agent of each row: hooks attributes it by rows;
    split cannot split a scalar and says so; so does hooks when it cannot match the rows."""
    model = lora_model("sp", torch.float32)
    case = LMCase(model, "sp")
    call = case.call(list(range(8)))
    expected = brute([call], lora_params(model)) / 64  # a mean over 8 rows is the sum / 8
    for method in ("hooks", "split"):
        model.zero_grad(set_to_none=True)
        probe = Probe(model, AGENTS, ROLES, method=method)
        with probe.step(0) as s:
            token_loss, ids = call(s)
            scalar = token_loss.sum(1).mean()
            if method == "split":
                with pytest.raises(ProbeError, match="cannot split a scalar loss"):
                    s.backward_rows(scalar, ids.max(1).values)
                continue
            s.backward_rows(scalar, ids.max(1).values)
        assert s.result.method == "hooks" and rel_err(s.result.gram, expected) < 1e-5
        probe.close()
    ip = lora_model("ip", torch.float32)
    ip_case = LMCase(ip, "ip")
    probe = Probe(ip, AGENTS, ROLES)
    with pytest.raises(ProbeError, match="split cannot split a scalar loss"):
        with probe.step(0) as s:
            token_loss, ids = ip_case.call(list(range(8)))(None)  # two untagged forwards
            s.backward_rows(token_loss.sum(), ids.max(1).values)


def test_a_scalar_loss_the_self_check_cannot_verify_is_said_once():
    """A scalar loss gives the self-check nothing to split: the first such step warns that the Gram rests on
    rows being independent (a model mixing rows would be wrong unseen); later steps do not repeat it."""
    model = lora_model("sp", torch.float32)
    call = LMCase(model, "sp").call(list(range(8)))
    probe = Probe(model, AGENTS, ROLES)
    said = []
    for step in range(2):
        model.zero_grad(set_to_none=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with probe.step(step) as s:
                token_loss, ids = call(s)
                s.backward_rows(token_loss.sum(1).mean(), ids.max(1).values)
        said.append([str(w.message) for w in caught if "cannot verify a scalar loss" in str(w.message)])
        assert s.result.method == "hooks"  # never "hooks+check": nothing was checked
    assert len(said[0]) == 1 and "rows independent" in said[0][0] and said[1] == []
    probe.close()


def test_backward_rows_bad_input():
    model = lora_model("sp", torch.float32)
    probe = Probe(model, AGENTS, ROLES)
    with probe.step(0) as s:
        with pytest.raises(ProbeError, match="shape"):
            s.backward_rows(torch.zeros(3, requires_grad=True), [0, 1])
        with pytest.raises(ProbeError, match="agent ids must be in"):
            s.backward_rows(torch.zeros(2, requires_grad=True), [0, 9])
        with pytest.raises(ProbeError, match=r"agent ids must be in \[-1, 3\], got -2"):
            s.backward_tokens(torch.zeros(2, 3, requires_grad=True), torch.tensor([[0, -2, 1], [1, 1, -1]]))
        with pytest.raises(ProbeError, match="non-zero loss"):
            s.backward_rows(torch.ones(2, requires_grad=True), ["voter0", None])
        with pytest.raises(ProbeError, match="unknown agent"):
            s.backward_rows(torch.zeros(2, requires_grad=True), ["voter0", "nobody"])
    assert np.all(s.result.gram == 0)


def test_chunked_forwards_in_one_tagged_block():
    """A framework computing log-probs in chunks of rows (TRL): the model calls inside one s.rows block
    take the block's rows in call order, each as many as its input's batch dimension holds."""
    model = lora_model("sp", torch.float32)
    case = LMCase(model, "sp")
    rows = list(range(8))
    expected = brute([case.call(rows)], lora_params(model))

    def call(s):
        with s.rows(case.ROW_AGENT[rows]):
            lp = torch.cat([case.logprobs(rows[:3]), case.logprobs(rows[3:])])
        ids = case.agent_ids[rows]
        return -case.adv[rows] * lp * (ids >= 0) / case.n_total, ids
    call.tags = True
    result, probe = run(model, "hooks", [call])
    assert probe._method.fallback_calls == 0 and result.method == "hooks+check"
    assert rel_err(result.gram, expected) < 1e-5
    probe = Probe(model, AGENTS, ROLES)
    with pytest.raises(ProbeError, match="hold more rows than its 4 agents"):
        with probe.step(0) as s, s.rows(case.ROW_AGENT[:4]):
            case.logprobs(rows[:3])
            case.logprobs(rows[3:])


def test_a_forward_never_back_propagated_is_not_a_candidate():
    """A grad-enabled forward whose graph is never back-propagated (a stale one, kept alive or not) does
    not make the rows of the real forward ambiguous."""
    model = lora_model("sp", torch.float32)
    case = LMCase(model, "sp")
    call = case.call(list(range(8)))
    expected = brute([call], lora_params(model))
    probe = Probe(model, AGENTS, ROLES)
    model.zero_grad(set_to_none=True)
    with probe.step(0) as s:
        kept = case.logprobs([0, 1])  # e.g. a logging forward with grad enabled, never back-propagated
        s.backward_tokens(*call())
    assert s.result.method == "hooks+check" and probe._method.fallback_calls == 0
    assert rel_err(s.result.gram, expected) < 1e-5 and kept.requires_grad


@pytest.mark.parametrize("stale_tagged", [True, False])
def test_a_forward_never_back_propagated_is_no_candidate_tagged_or_not(stale_tagged):
    """A grad-enabled forward the loss does not reach (for logging, say) next to the tagged forward the
    backward goes through: the Gram is the brute force's, by hooks."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 5))
    agents, roles = ["a", "b", "c"], {"a": "x", "b": "y", "c": "y"}
    rows, X = [0, 1, 2, 0, 1, 2], torch.randn(6, 4, 6)
    probe = Probe(model, agents, roles)
    with probe.step(0) as s:
        if stale_tagged:
            with s.rows(rows):
                model(X * 3)
        else:
            model(X * 3)
        with s.rows(rows):
            token_loss = (model(X) ** 2).sum(-1)                              # (6, 4)
        ids = torch.tensor(rows)[:, None].expand(6, 4)
        s.backward_tokens(token_loss, ids)
    params = list(model.parameters())
    token_loss = (model(X) ** 2).sum(-1)
    terms = {a: token_loss[torch.tensor(rows) == k].sum() for k, a in enumerate(agents)}
    want = brute_force_gram_of(terms, params, agents)
    assert s.result.method == "hooks+check" and rel_err(s.result.gram, want) < 1e-5


def brute_force_gram_of(terms: dict[str, torch.Tensor], params: list[nn.Parameter], agents: list[str]) -> np.ndarray:
    g = torch.stack([torch.cat([x.reshape(-1) for x in torch.autograd.grad(terms[a], params, retain_graph=True)])
                     .double() for a in agents])
    return (g @ g.T).numpy()


def test_a_closed_probe_refuses_a_step():
    model = nn.Sequential(nn.Linear(4, 3))
    probe = Probe(model, ["a", "b"], {"a": "x", "b": "y"})
    probe.close()
    with pytest.raises(ProbeError, match="the probe is closed"):
        with probe.step(0):
            pass


# ---------------------------------------------------------------- what a passed check verifies
def seq_first_steps(method: str, advantages, T: int = 4, **kw) -> list[str]:
    """Probed steps of :func:`seq_first_case`'s layer (T == B: the batch dimension is a guess) with the given
    advantages per step, each Gram checked against brute force where the step ends; the records' methods, or
    the error's message."""
    layer, params, _, _, _ = seq_first_case(T=T)
    probe = Probe(layer, AGENTS, ROLES, params=params, method=method, **kw)
    seen = []
    try:
        for step, adv in enumerate(advantages):
            x = torch.randn(T, 4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
            adv = torch.tensor(adv, dtype=torch.float64)[:, None]
            ids = ROW_AGENT[:, None].expand(4, T)

            def forward():
                return adv * layer(x).square().sum(-1).T / 10  # (B, T)
            expected = brute_force_gram({a: forward()[ids == k].sum() for k, a in enumerate(AGENTS)},
                                        [p for _, p in params])
            layer.zero_grad(set_to_none=True)
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)
                    with probe.step(step) as s:
                        s.backward_tokens(forward(), ids)
            except ProbeError as e:
                seen.append(str(e))
                continue
            assert np.abs(s.result.gram - expected).max() <= 1e-10 * np.abs(expected).max(), (step, s.result.method)
            seen.append(s.result.method)
    finally:
        probe.close()
    return seen


ZERO, ADV = [0.0, 0.0, 0.0, 0.0], [1.0, -0.5, 0.8, 0.3]


@pytest.mark.parametrize("method", ["hooks", "auto"])
def test_a_check_with_every_gradient_zero_verifies_nothing_and_stays_due(method):
    """A first step whose advantages are all 0 (a GRPO group of equal rewards): any attribution gives the zero
    Gram, so its check confirms no batch dimension and is not recorded as one; the next step checks, and finds
    the guessed dimension wrong (once it was fixed, and later steps were 63-78 % off, recorded as hooks)."""
    seen = seq_first_steps(method, [ZERO, ADV, ADV])
    assert seen[0] == "hooks"
    if method == "hooks":
        assert all("self-check" in m and "batch_dim" in m for m in seen[1:])
    else:
        assert seen[1:] == ["split-fallback:check-failed"] * 2


def test_the_check_compares_each_parameter_s_gram_too():
    """A small sequence-first side layer (T == B) beside a large batch-first one, in fp32: misattributing its rows
    moved the group's Gram by ~6e-4 at a 1e-3 scale, inside the tolerance, and the wrong dimension was fixed (37 %
    off at the next step); each parameter's own Gram is compared too, so the first step catches it."""
    class Side(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.big, self.side, self.scale = nn.Linear(8, 8), nn.Linear(8, 8), 1e-3

        def forward(self, x):  # x (B, T, 8)
            h = torch.tanh(self.big(x))
            h = h + self.scale * torch.tanh(self.side(h.transpose(0, 1)).transpose(0, 1))  # side sees (T, B, 8)
            return (h + h.mean(1, keepdim=True)).square().sum(-1)  # (B, T)

    model = Side()
    probe = Probe(model, AGENTS, ROLES, method="hooks")
    x = torch.randn(4, 4, 8, generator=torch.Generator().manual_seed(0))
    adv = torch.tensor(ADV)[:, None]
    try:
        with pytest.raises(ProbeError, match=r"layer 'side'.*batch_dim"):
            with probe.step(0) as s:
                s.backward_tokens(adv * model(x), ROW_AGENT[:, None].expand(4, 4))
    finally:
        probe.close()


class Centred(nn.Module):
    """Rows mixed by a term across the batch (BatchNorm without affine, in training)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(5, 16), nn.BatchNorm1d(16, affine=False), nn.Tanh(), nn.Linear(16, 3)).double()

    def forward(self, x):
        return self.net(x).square().sum(-1)  # (B,)


def test_a_layer_called_in_two_layouts_has_each_call_s_dimension_verified():
    """One Linear called on a sequence-first (T, B, d) and a batch-first (B, S, d) input in each forward: the
    check confirms each call's dimension (1, then 0); when T == S == B the shapes cannot tell them apart, and
    one dimension for the layer put the second call's rows at the wrong agents (9-25 % off, recorded hooks)."""
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.proj, self.head = nn.Linear(6, 6).double(), nn.Linear(6, 1).double()

        def forward(self, seq_first, batch_first):  # (T, B, 6), (B, S, 6)
            h = torch.cat([torch.tanh(self.proj(seq_first)).transpose(0, 1), torch.tanh(self.proj(batch_first))], 1)
            return self.head(h + h.mean(1, keepdim=True)).squeeze(-1)  # (B, T + S)

    model = Twice()
    probe = Probe(model, AGENTS, ROLES, method="hooks")
    seen = []
    try:
        for step, (T, S) in enumerate([(5, 3), (4, 4), (4, 4)]):
            g = torch.Generator().manual_seed(step)
            xs, xb = torch.randn(T, 4, 6, dtype=torch.float64, generator=g), torch.randn(4, S, 6, dtype=torch.float64, generator=g)
            adv = torch.randn(4, 1, dtype=torch.float64, generator=g)
            ids = ROW_AGENT[:, None].expand(4, T + S)
            expected = brute_force_gram({a: (adv * model(xs, xb).square())[ids == k].sum() for k, a in enumerate(AGENTS)},
                                        list(model.parameters()))
            model.zero_grad(set_to_none=True)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                with probe.step(step) as s:
                    s.backward_tokens(adv * model(xs, xb).square(), ids)
            assert rel_err(s.result.gram, expected) < 1e-10
            seen.append(s.result.method)
        state = probe.state_dict()["state"]
    finally:
        probe.close()
    # step 1: the second call (now with T == S == B) was never verified: split, and the next step checks it
    assert seen == ["hooks+check", "split-fallback:unmatched-rows", "hooks+check"]
    assert state["batch_dims"] == {"proj": 1, "proj#1": 0}
    restored = Probe(Twice(), AGENTS, ROLES, method="hooks")
    restored.load_state_dict(probe.state_dict())
    assert restored.state_dict()["state"]["batch_dims"] == {"proj": 1, "proj#1": 0}
    restored.close()


@pytest.mark.parametrize("agents", [[0, -1, 2, -1], [0, 1, 2, -1]])
def test_a_failed_check_with_rows_of_no_agent_names_the_guessed_dimension(agents):
    """Sequence-first, T == B, some rows of no agent: those rows receive gradient too (the add-up check's
    error), but the cause is the guessed batch dimension, which the check's error names."""
    layer, params, _, _, _ = seq_first_case(T=4)
    probe = Probe(layer, AGENTS, ROLES, params=params, method="hooks")
    x = torch.randn(4, 4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    rows = torch.tensor(agents)
    adv = torch.tensor(ADV, dtype=torch.float64)[:, None] * (rows >= 0)[:, None]
    try:
        with pytest.raises(ProbeError, match=r"self-check.*layer 'linear[12]'.*batch_dim"):
            with probe.step(0) as s:
                s.backward_tokens(adv * layer(x).square().sum(-1).T, rows[:, None].expand(4, 4))
    finally:
        probe.close()


def test_row_tags_and_batch_dim_are_validated():
    """A negative or non-integer batch_dim, and float or bool agents, are refused with a ProbeError (a float
    agent 1.7 was taken as 1; batch_dim=-1 ended in a raw RuntimeError with every .grad lost)."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    probe = Probe(model, AGENTS, ROLES, method="hooks")
    x = torch.randn(4, 3, 8)
    try:
        with probe.step(0) as s:
            for bad in (-1, -2, 1.0, True):
                with pytest.raises(ProbeError, match="batch_dim must be a non-negative dimension index"):
                    with s.rows(ROW_AGENT, batch_dim=bad):
                        pass
            for agents in (torch.tensor([0.0, 1.7, 2.0, 3.9]), torch.tensor([True, False, True, False])):
                with pytest.raises(ProbeError, match="agent_of_row must be integers"):
                    with s.rows(agents):
                        pass
                with pytest.raises(ProbeError, match="agent_of_row must be integers"):
                    s.backward_rows(model(x).sum((1, 2)), agents)
            s.backward_rows(model(x).sum((1, 2)), ROW_AGENT)
        assert s.result.method == "hooks+check"
    finally:
        probe.close()


def test_a_second_backward_through_a_retained_forward_says_so():
    """retain_graph=True and a second loss through the same forward: split measures it (right Gram), and the
    warning names the retained graph as the cause."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    x = torch.randn(4, 3, 8, dtype=torch.float64)
    probe = Probe(model, AGENTS, ROLES, method="hooks")
    try:
        with probe.step(0) as s:
            out = model(x).squeeze(-1)  # (B, T)
            s.backward_tokens(out.square(), ROW_AGENT[:, None].expand(4, 3), retain_graph=True)
            with pytest.warns(RuntimeWarning, match="already back-propagated.*retain_graph=True"):
                s.backward_tokens(out.sin(), ROW_AGENT[:, None].expand(4, 3))
        assert s.result.method == "split-fallback:unmatched-rows"
    finally:
        probe.close()


def test_a_layer_the_loss_never_reaches_needs_no_verified_dimension():
    """A sequence-first model (T != B: dimension 1 is a guess) with a probed head called every forward but not
    in the loss: the check sees no gradient of it, so its dimension stays unverified, and a call the loss does
    not reach needs none (it went through split every other step, re-arming the check, for good)."""
    torch.manual_seed(0)
    model = nn.ModuleDict(dict(body=nn.Linear(3, 6), head=nn.Linear(6, 1), aux=nn.Linear(6, 2))).double()
    probe = Probe(model, AGENTS, ROLES, method="hooks")
    g, seen = torch.Generator().manual_seed(0), []
    try:
        for step in range(4):
            x, adv = torch.randn(5, 8, 3, dtype=torch.float64, generator=g), torch.randn(8, dtype=torch.float64, generator=g)
            rows = torch.arange(8) % 4

            def loss():
                h = torch.tanh(model["body"](x))  # (T, B, 6)
                model["aux"](h)                   # a value head this loss does not use
                return adv * model["head"](h)[..., 0].sum(0)
            expected = brute_force_gram({a: loss()[rows == k].sum() for k, a in enumerate(AGENTS)},
                                        [p for n, p in model.named_parameters() if not n.startswith("aux")])
            model.zero_grad(set_to_none=True)
            with probe.step(step) as s:
                s.backward_rows(loss(), rows)
            assert rel_err(s.result.gram, expected) < 1e-10
            seen.append(s.result.method)
    finally:
        probe.close()
    assert seen == ["hooks+check", "hooks", "hooks", "hooks"]


@pytest.mark.parametrize("first", ["one-agent", "zero-advantage-mix"])
def test_rows_of_several_agents_that_no_check_has_seen_with_gradient_go_through_split(first):
    """A first step of one agent's rows (or, beside them, rows of several agents with every advantage 0) shows
    the check nothing of a model mixing rows (BatchNorm): later steps were 2-24 % off, recorded hooks. Now the
    next call with rows of several agents, which the default schedule would not check, goes through split
    (right Gram, a warning saying why), and the step after it is checked: it catches the mixing."""
    model = Centred()
    probe = Probe(model, AGENTS, ROLES, method="auto")
    seen = []
    try:
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            one = (torch.full((8,), 2), torch.randn(8, dtype=torch.float64, generator=g))
            mixed = (torch.arange(8) % 4, torch.randn(8, dtype=torch.float64, generator=g))
            calls = [mixed] if step else [one] if first == "one-agent" else [(mixed[0], mixed[1] * 0), one]
            xs = [torch.randn(8, 5, dtype=torch.float64, generator=g) for _ in calls]
            expected = brute_force_gram({a: sum((adv * model(x))[rows == k].sum() for (rows, adv), x in zip(calls, xs))
                                         for k, a in enumerate(AGENTS)}, list(model.parameters()))
            model.zero_grad(set_to_none=True)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with probe.step(step) as s:
                    for (rows, adv), x in zip(calls, xs):
                        s.backward_rows(adv * model(x), rows)
            assert rel_err(s.result.gram, expected) < 1e-10
            seen.append(s.result.method)
            if step == 1:
                assert any("no self-check has yet seen such rows" in str(w.message) for w in caught)
    finally:
        probe.close()
    assert seen == ["hooks+check", "split-fallback:unmatched-rows", "split-fallback:check-failed"]


# ---------------------------------------------------------------- calls on selected or routed vectors
class Routed(nn.Module):
    """Embedding → two nn.Linear experts, each called on the (n, d) token vectors routed to it (the
    Mixtral / Switch layout; here a token goes to expert ``id % 2``) → head on (B, T, d)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(20, 8)
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids (B, T) → (B, T)
        x = self.emb(ids).reshape(-1, 8)
        out = x
        for e, expert in enumerate(self.experts):
            where = (ids.reshape(-1) % 2 == e).nonzero().squeeze(1)
            out = out.index_add(0, where, expert(x[where]))
        return self.head(torch.tanh(out).reshape(*ids.shape, 8)).squeeze(-1)


# B = 4 rows of 2 tokens: each expert gets 4 = B tokens. Step 0: one token of each row per expert (routed vector i
# is row i's); step 1: rows 0-1 send both tokens to expert 0, rows 2-3 to expert 1 (vector i is no longer row i).
ROUTES = [torch.tensor([[2, 3], [4, 5], [6, 7], [8, 9]]), torch.tensor([[2, 4], [6, 8], [3, 5], [7, 9]])]


@pytest.mark.parametrize("experts_only", [False, True])
@pytest.mark.parametrize("check_every", [0, None])
def test_vectors_routed_to_a_layer_are_never_taken_for_rows_unchecked(check_every, experts_only):
    """Every expert's input (B, d) has a leading dimension of size B, as a per-row input would: a passed check at
    step 0 fixed it and step 1 (another routing) was recorded as hooks, 11 % off without a warning (51 % with
    only the experts probed). Such a call is attributed by hooks only in a step whose check verifies it; else it
    goes to split (right Gram) and the warning says why."""
    model = Routed().double()
    params = [(n, p) for n, p in model.named_parameters() if not experts_only or n.startswith("experts")]
    probe = Probe(model, AGENTS, ROLES, method="auto", check_every=check_every, params=params)
    methods = []
    try:
        for step, ids in enumerate(ROUTES):
            adv = torch.tensor(ADV, dtype=torch.float64)[:, None]
            agent_ids = ROW_AGENT[:, None].expand(4, 2)
            want = brute_force_gram({a: (adv * model(ids))[agent_ids == k].sum() for k, a in enumerate(AGENTS)},
                                    [p for _, p in params])
            model.zero_grad(set_to_none=True)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with probe.step(step) as s:
                    s.backward_tokens(adv * model(ids), agent_ids)
            methods.append(s.result.method)
            assert rel_err(s.result.gram, want) < 1e-10, (step, s.result.method)
            if s.result.method == "split-fallback:unmatched-rows":
                assert any("routed to it" in str(w.message) and "method='split'" in str(w.message) for w in caught)
    finally:
        probe.close()
    assert methods == (["hooks+check", "split-fallback:unmatched-rows"] if check_every == 0 else
                       ["split-fallback:unmatched-rows"] * 2)


@pytest.mark.parametrize("unit_axis", [False, True])
def test_a_head_on_the_scored_tokens_is_not_blamed_on_the_row_tags(unit_axis):
    """A head applied to the scored tokens only (N of them; N == B here; also as (N, 1, d)) with no check: split
    (right Gram), not the add-up check's error blaming the row tags for gradient on rows of no agent."""
    torch.manual_seed(0)
    body, head = nn.Linear(8, 8).double(), nn.Linear(8, 1).double()
    model = nn.ModuleDict({"body": body, "head": head})
    x = torch.randn(4, 3, 8, dtype=torch.float64)
    agent_ids = torch.tensor([[0, -1, -1], [1, 1, -1], [2, -1, -1], [-1, -1, -1]])  # 4 scored tokens, B = 4

    def token_loss():
        h = torch.tanh(body(x))
        selected = h[agent_ids >= 0][:, None] if unit_axis else h[agent_ids >= 0]
        out = torch.zeros(4, 3, dtype=torch.float64).index_put((agent_ids >= 0).nonzero(as_tuple=True),
                                                               head(selected).reshape(-1))
        return out.square()
    want = brute_force_gram({a: token_loss()[agent_ids == k].sum() for k, a in enumerate(AGENTS)},
                            list(model.parameters()))
    probe = Probe(model, AGENTS, ROLES, method="auto", check_every=None)
    try:
        with pytest.warns(RuntimeWarning, match="layer 'head'.*routed to it"):
            with probe.step(0) as s:
                s.backward_tokens(token_loss(), agent_ids)
    finally:
        probe.close()
    assert s.result.method == "split-fallback:unmatched-rows" and rel_err(s.result.gram, want) < 1e-10


class PooledHead(nn.Module):
    """Embedding → Linear on every token → mean over the row → Linear head on one vector per row: (B, T) → (B,)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.body, self.head = nn.Embedding(20, 8), nn.Linear(8, 8), nn.Linear(8, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(self.emb(ids))).mean(1)).squeeze(-1)


@pytest.mark.parametrize("declared", [False, True])
def test_a_head_on_one_vector_per_row(declared):
    """The head's (B, d) input is one vector per row here, but shapes cannot tell it from routed ones: undeclared,
    each step is checked or goes to split (right Gram either way; split cannot run under grad_reduced: an error
    saying to declare it); declared with batch_dim=0, hooks every step, also under grad_reduced and for a
    scalar loss."""
    model = PooledHead().double()
    adv = torch.tensor(ADV, dtype=torch.float64)
    for kw in ({}, {"grad_reduced": True}):
        probe = Probe(model, AGENTS, ROLES, **kw)
        methods = []
        try:
            for step in range(3):
                ids = torch.randint(0, 20, (4, 5), generator=torch.Generator().manual_seed(step))
                want = brute_force_gram({a: (adv * model(ids).square())[k] for k, a in enumerate(AGENTS)},
                                        list(model.parameters()))
                model.zero_grad(set_to_none=True)
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore", RuntimeWarning)
                        with probe.step(step) as s:
                            with s.rows(ROW_AGENT, batch_dim=0) if declared else nullcontext():
                                out = model(ids)
                            loss = adv * out.square()
                            s.backward_rows(loss.sum() if declared and step == 2 else loss, ROW_AGENT)
                except ProbeError as e:
                    assert "grad_reduced" in kw and "routed to it" in str(e) and "batch_dim=0" in str(e)
                    methods.append("error")
                    continue
                methods.append(s.result.method)
                assert rel_err(s.result.gram, want) < 1e-10, (kw, step, s.result.method)
        finally:
            probe.close()
        if declared:
            assert methods == ["hooks+check", "hooks", "hooks"], kw
        else:
            assert methods == ["hooks+check", "error" if kw else "split-fallback:unmatched-rows", "hooks+check"], kw


class WithAside(nn.Module):
    """A per-sample model (input (B, d)) that also runs a probed layer on 3B vectors the loss never reaches."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body, self.aside, self.head = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.aside(x.repeat(3, 1)).detach()  # (a statistic the loss does not use)
        return self.head(torch.tanh(self.body(x))).squeeze(-1)


def routed_by_parts(model: Routed, ids: torch.Tensor) -> torch.Tensor:
    """Routed's forward through its submodules, never calling the model: its input is not seen."""
    return Routed.forward(model, ids)


@pytest.mark.parametrize("case", ["per-sample", "unreached-aside", "experts-per-row-loss", "no-model-call"])
def test_b_vectors_are_judged_by_the_positions_of_their_forward(case):
    """(B, d) inputs are B vectors of a forward of B positions in a per-sample model: hooks, also beside a call
    the loss does not reach on more vectors. Routed ones are caught also with a per-row loss and only the experts
    probed (the model's input is what tells), and when the model itself is never called (positions unknown)."""
    routed = case in ("experts-per-row-loss", "no-model-call")
    model = (Routed() if routed else WithAside() if case == "unreached-aside" else
             nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))).double()
    params = [(n, p) for n, p in model.named_parameters() if not routed or n.startswith("experts")]
    adv = torch.tensor(ADV, dtype=torch.float64)

    def row_loss(step: int) -> torch.Tensor:
        if routed:
            out = (routed_by_parts if case == "no-model-call" else Routed.__call__)(model, ROUTES[step])
            return adv * out.square().sum(1)
        x = torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
        return adv * model(x).squeeze(-1).square()
    probe = Probe(model, AGENTS, ROLES, params=params)
    methods = []
    try:
        for step in range(2):
            want = brute_force_gram({a: row_loss(step)[k] for k, a in enumerate(AGENTS)}, [p for _, p in params])
            model.zero_grad(set_to_none=True)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                with probe.step(step) as s:
                    s.backward_rows(row_loss(step), ROW_AGENT)
            methods.append(s.result.method)
            assert rel_err(s.result.gram, want) < 1e-10, (step, s.result.method)
    finally:
        probe.close()
    assert methods == (["hooks+check", "split-fallback:unmatched-rows"] if routed else ["hooks+check", "hooks"])


class ChunkBody(nn.Module):
    """Embedding → Linear (called in chunks of rows); ``head`` is called by the loop, outside the model's forward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.body, self.head = nn.Embedding(11, 6), nn.Linear(6, 6), nn.Linear(6, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.body(self.emb(ids)))


def test_a_layer_called_after_chunked_model_calls_holds_the_whole_block():
    """One s.rows block calls the model on 3 rows, then on 1, then the model's head on the last position of all
    4 rows ((B, 1, d)): the head's call went to the last chunk's forward (1 row, one agent) and was attributed to
    that agent whole — hooks, 49 % off. It now holds the block's 4 rows (positions unknown: checked or split)."""
    model = ChunkBody().double()
    ids = torch.randint(0, 11, (4, 5), generator=torch.Generator().manual_seed(0))
    adv = torch.tensor(ADV, dtype=torch.float64)

    def row_loss() -> torch.Tensor:
        h = torch.cat([model(ids[:3]), model(ids[3:])])
        return adv * model.head(h[:, -1:]).reshape(4).square()
    probe = Probe(model, AGENTS, ROLES)
    methods = []
    try:
        for step, agents in enumerate(([0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 1])):
            agents = torch.tensor(agents)
            want = brute_force_gram({a: row_loss()[agents == k].sum() for k, a in enumerate(AGENTS)},
                                    list(model.parameters()))
            model.zero_grad(set_to_none=True)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                with probe.step(step) as s:
                    with s.rows(agents):
                        loss = row_loss()
                    s.backward_rows(loss, agents)
            methods.append(s.result.method)
            assert rel_err(s.result.gram, want) < 1e-10, (step, s.result.method)
    finally:
        probe.close()
    assert methods == ["hooks+check", "split-fallback:unmatched-rows", "hooks+check"]
