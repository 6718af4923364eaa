"""The split probe against brute force: one torch.autograd.grad per agent on the same batch."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn as nn

from gradscope.errors import ProbeError
from gradscope.peft_support import adapter_parameters, use_adapter
from gradscope.probe import Probe
from tests.gradscope.tiny_lm import batch, tiny_lora_lm, token_logprobs

AGENTS = ["voter0", "voter1", "voter2", "aggregator"]
ROLES = {"voter0": "voter", "voter1": "voter", "voter2": "voter", "aggregator": "aggregator"}


def brute_force_gram(loss_terms: dict[str, torch.Tensor], params: list[nn.Parameter]) -> np.ndarray:
    """M_kl from a separate autograd.grad per agent, flattened and multiplied in float64."""
    rows = []
    for agent in AGENTS:
        grads = torch.autograd.grad(loss_terms[agent], params, retain_graph=True, allow_unused=True)
        rows.append(torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1)
                               for g, p in zip(grads, params)]).double())
    g = torch.stack(rows)
    return (g @ g.T).numpy()


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


# ---------------------------------------------------------------- plain nn.Module
def mlp_terms(model: nn.Module, seed: int, n: int = 6) -> dict[str, torch.Tensor]:
    """Each agent regresses its own batch; terms normalised by the step's total sample count."""
    g = torch.Generator().manual_seed(seed)
    total = n * len(AGENTS)
    terms = {}
    for agent in AGENTS:
        x, y = torch.randn(n, 5, generator=g), torch.randn(n, 3, generator=g)
        terms[agent] = ((model(x) - y) ** 2).sum() / total
    return terms


def make_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3))


def test_parameters_of_one_name_are_refused():
    """A name keys a parameter's group, state and sketch hash: two parameters named alike (each submodule's
    named_parameters()) made the sketch hash them alike, its Gram biased ×2 and unseen."""
    model = make_mlp()
    named = list(model[0].named_parameters()) + list(model[2].named_parameters())
    with pytest.raises(ProbeError, match="two parameters are both named 'bias'"):
        Probe(model, AGENTS, ROLES, params=named, sketch=8)
    Probe(model, AGENTS, ROLES, params=list(model.parameters()), sketch=8).close()  # bare: param0, param1, ...


def test_mlp_gram_equals_brute_force_and_grad_is_unchanged():
    model = make_mlp()
    reference = copy.deepcopy(model)
    params = list(model.parameters())
    expected = brute_force_gram(mlp_terms(model, 1), params)

    probe = Probe(model, AGENTS, ROLES)
    with probe.step(0) as s:
        s.backward(mlp_terms(model, 1), tokens={a: 6 for a in AGENTS})
    assert rel_err(s.result.gram, expected) < 1e-6
    assert s.result.tokens.tolist() == [6, 6, 6, 6]
    assert s.result.group_gram.shape == (1, 4, 4)

    sum(mlp_terms(reference, 1).values()).backward()  # the unprobed step
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)
    g = torch.cat([q.grad.reshape(-1) for q in reference.parameters()]).double()
    assert s.result.gram.sum() == pytest.approx(float(g @ g), rel=1e-6)  # Σ_kl M_kl = ‖Σ_k g_k‖²


def test_gradient_accumulation_gives_the_big_batch_gram():
    model = make_mlp()
    g = torch.Generator().manual_seed(3)
    data = {a: (torch.randn(8, 5, generator=g), torch.randn(8, 3, generator=g)) for a in AGENTS}
    total = 8 * len(AGENTS)

    def terms(rows: slice) -> dict[str, torch.Tensor]:
        return {a: ((model(x[rows]) - y[rows]) ** 2).sum() / total for a, (x, y) in data.items()}

    probe = Probe(model, AGENTS, ROLES)
    with probe.step(0) as big:
        big.backward(terms(slice(0, 8)))
    big_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    with probe.step(0) as acc:
        acc.backward(terms(slice(0, 3)))
        acc.backward(terms(slice(3, 8)))
    assert rel_err(acc.result.gram, big.result.gram) < 1e-6
    for p, q in zip(model.parameters(), big_grads):
        torch.testing.assert_close(p.grad, q, rtol=1e-6, atol=1e-7)


def test_existing_grad_is_kept_and_unused_params_stay_none():
    model = make_mlp()
    extra = nn.Parameter(torch.ones(3))  # probed but never used: its .grad must stay None
    model[0].weight.grad = torch.full_like(model[0].weight, 0.5)
    params = [("w0", model[0].weight), ("b0", model[0].bias), ("w2", model[2].weight),
              ("b2", model[2].bias), ("extra", extra)]
    reference = copy.deepcopy(model)
    reference[0].weight.grad = torch.full_like(reference[0].weight, 0.5)
    probe = Probe(None, AGENTS, ROLES, params=params, groups={"first": ["w0", "b0"], "rest": ["w2", "b2", "extra"]})
    with probe.step(0) as s:
        s.backward(mlp_terms(model, 2))
    sum(mlp_terms(reference, 2).values()).backward()
    assert extra.grad is None
    torch.testing.assert_close(model[0].weight.grad, reference[0].weight.grad, rtol=1e-6, atol=1e-7)
    assert probe.groups == ["first", "rest"] and probe.group_sizes == [96, 51 + 3]
    np.testing.assert_allclose(s.result.group_gram.sum(0), s.result.gram)


def test_agent_without_terms_has_zero_row_and_errors_are_clear():
    model = make_mlp()
    probe = Probe(model, AGENTS, ROLES)
    terms = mlp_terms(model, 4)
    del terms["voter2"]
    with probe.step(7, policy="voter") as s:
        s.backward(terms)
    assert s.result.step == 7 and s.result.policy == "voter"
    assert np.all(s.result.gram[2] == 0) and np.all(s.result.gram[:, 2] == 0)
    with pytest.raises(ProbeError, match="unknown agent"):
        with probe.step(8) as s:
            s.backward({"nobody": torch.zeros((), requires_grad=True)})
    with pytest.raises(ProbeError, match="no role"):
        Probe(model, AGENTS, {"voter0": "voter"})
    with pytest.raises(ProbeError, match="unknown probe method"):
        Probe(model, AGENTS, ROLES, method="magic")


def test_failed_step_restores_grads():
    model = make_mlp()
    probe = Probe(model, AGENTS, ROLES)
    with pytest.raises(RuntimeError, match="boom"):
        with probe.step(0) as s:
            s.backward(mlp_terms(model, 5))
            raise RuntimeError("boom")
    reference = copy.deepcopy(model)
    reference.zero_grad(set_to_none=True)
    sum(mlp_terms(reference, 5).values()).backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)


def test_nonfinite_gradient_is_measured_not_raised():
    model = make_mlp()
    probe = Probe(model, AGENTS, ROLES)
    terms = mlp_terms(model, 6)
    terms["voter1"] = terms["voter1"] * torch.tensor(float("nan"))
    with probe.step(0) as s:
        s.backward(terms)
    assert not s.result.finite
    assert np.isfinite(s.result.gram[0, 0])


# ---------------------------------------------------------------- HF causal LM with LoRA
def lm_terms(model, seed: int, shared_adapter: bool) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """Policy-gradient-like loss: -advantage × log p(token), summed per agent over padded batches.

    Voters share one padded batch (their sequences interleaved); the aggregator has its own.
    Normalised by the step's total token count, as a token-mean GRPO loss is.
    """
    ids, mask = batch(6, 12, seed, pad_left=3)  # rows 0..5 → voters 0,1,2,0,1,2
    adv = torch.linspace(-1, 1, 6)[:, None]
    agg_ids, agg_mask = batch(2, 12, seed + 100, pad_left=2)
    n_total = int(mask[:, 1:].sum() + agg_mask[:, 1:].sum())

    def forward(adapter, ids, mask):
        if shared_adapter:
            return token_logprobs(model, ids, mask)
        with use_adapter(model, adapter):
            return token_logprobs(model, ids, mask)

    voter_lp = -adv * forward("voter", ids, mask) / n_total
    agg_lp = -forward("aggregator", agg_ids, agg_mask) / n_total
    terms = {f"voter{k}": voter_lp[k::3].sum() for k in range(3)}
    terms["aggregator"] = agg_lp.sum()
    tokens = {f"voter{k}": int(mask[k::3, 1:].sum()) for k in range(3)}
    tokens["aggregator"] = int(agg_mask[:, 1:].sum())
    return terms, tokens


@pytest.mark.parametrize("policy", ["sp", "ip"])
def test_lora_lm_gram_equals_brute_force(policy):
    adapters = ["shared"] if policy == "sp" else ["voter", "aggregator"]
    model = tiny_lora_lm(adapters)
    params = [p for ps in adapter_parameters(model).values() for _, p in ps]
    terms, tokens = lm_terms(model, 11, shared_adapter=policy == "sp")
    expected = brute_force_gram(terms, params)

    probe = Probe(model, AGENTS, ROLES, groups="adapter")
    assert probe.groups == adapters and len(probe.param_names) == len(params)
    terms, tokens = lm_terms(model, 11, shared_adapter=policy == "sp")
    with probe.step(0) as s:
        s.backward(terms, tokens=tokens)
    assert rel_err(s.result.gram, expected) < 1e-6
    M = s.result.gram
    if policy == "ip":
        assert np.all(M[:3, 3] == 0) and np.all(M[3, :3] == 0)  # disjoint adapters: exactly 0
        voter_group, agg_group = s.result.group_gram
        assert np.all(voter_group[3] == 0) and np.all(agg_group[:3] == 0)
    else:
        assert np.abs(M[:3, 3]).min() > 0
    assert np.all(np.diag(M) > 0)

    reference = tiny_lora_lm(adapters)
    ref_terms, _ = lm_terms(reference, 11, shared_adapter=policy == "sp")
    sum(ref_terms.values()).backward()
    probed = dict(model.named_parameters())
    for name, q in reference.named_parameters():
        if q.grad is not None:
            torch.testing.assert_close(probed[name].grad, q.grad, rtol=1e-5, atol=1e-8)
        else:
            assert probed[name].grad is None


def test_backward_tokens_matches_dict_terms_and_spans_sequences():
    """One agent's tokens spread over several (padded) sequences, attributed per token."""
    model = tiny_lora_lm(["shared"])
    ids, mask = batch(6, 12, 21, pad_left=4)
    agent_ids = torch.tensor([0, 1, 2, 0, 1, 3])[:, None].expand(6, 11).clone()
    agent_ids[mask[:, 1:] == 0] = -1
    adv = torch.linspace(-1, 1, 6)[:, None]
    n_total = int(mask[:, 1:].sum())

    def token_loss():
        return -adv * token_logprobs(model, ids, mask) / n_total

    params = [p for _, p in adapter_parameters(model)["shared"]]
    loss = token_loss()
    expected = brute_force_gram({a: loss[agent_ids == k].sum() for k, a in enumerate(AGENTS)}, params)
    probe = Probe(model, AGENTS, ROLES)
    with probe.step(0) as s:
        s.backward_tokens(token_loss(), agent_ids)
    assert rel_err(s.result.gram, expected) < 1e-6
    assert s.result.tokens.tolist() == [int((agent_ids == k).sum()) for k in range(4)]
    with pytest.raises(ProbeError, match="agent id -1"):
        with probe.step(1) as s:
            s.backward_tokens(token_loss(), torch.full_like(agent_ids, -1))


def test_use_adapter_avoids_peft_requires_grad_pitfall():
    """peft's set_adapter freezes the other adapter; a forward made under it would lose its grads."""
    model = tiny_lora_lm(["voter", "aggregator"])
    model.set_adapter("aggregator")
    voter = adapter_parameters(model)["voter"]
    assert not any(p.requires_grad for _, p in voter)  # the pitfall is real in this peft
    with use_adapter(model, "voter"):
        assert all(p.requires_grad for ps in adapter_parameters(model).values() for _, p in ps)
    assert model.active_adapter == "aggregator"


def test_split_hands_each_term_s_gradients_and_keeps_grad_the_running_sum():
    """backward_per_agent: the sink gets each term's gradients (autograd.grad's, term by term), once per term;
    .grad ends as one unprobed backward of all terms leaves it — with a dense .grad already there, one that is
    None, a sparse embedding's (already there, and not), and a parameter no term reaches."""
    from gradscope.probe.split import backward_per_agent

    def model():
        torch.manual_seed(0)
        return nn.ModuleDict({"emb": nn.Embedding(6, 3, sparse=True), "sp": nn.Embedding(6, 3, sparse=True),
                              "lin": nn.Linear(3, 2), "idle": nn.Linear(2, 2)})

    def terms(m):
        ids = torch.tensor([[0, 1, 2], [3, 4, 1]])
        out = m["lin"](m["emb"](ids) + m["sp"](ids))  # (2, 3, 2)
        return [(k, out[k].square().sum() * (k + 1)) for k in range(2)]

    probed, plain = model(), model()
    for m in (probed, plain):  # already there: lin.weight (dense), sp.weight (sparse)
        m["lin"].weight.grad = torch.full_like(m["lin"].weight, 0.5)
        (m["sp"](torch.tensor([5, 1])) * 0.25).sum().backward()
        assert m["sp"].weight.grad.is_sparse
    reference = model()
    expected = {k: torch.autograd.grad(t, list(reference.parameters()), allow_unused=True, retain_graph=True)
                for k, t in terms(reference)}
    sum(t for _, t in terms(plain)).backward()
    params = list(probed.parameters())
    got: list[tuple[int, dict[int, torch.Tensor]]] = []
    backward_per_agent(params, terms(probed), False, lambda k, grads: got.append((k, {i: g.clone() for i, g in grads})))
    assert [k for k, _ in got] == [0, 1]
    for k, grads in got:
        reached = {i for i, g in enumerate(expected[k]) if g is not None}
        assert set(grads) == reached and not any(g.is_sparse for g in grads.values())
        for i in reached:
            torch.testing.assert_close(grads[i], expected[k][i].to_dense())
    for (name, p), q in zip(probed.named_parameters(), plain.parameters()):
        if q.grad is None:
            assert p.grad is None, name
        else:
            torch.testing.assert_close(p.grad.to_dense(), q.grad.to_dense(), msg=name)


# ---------------------------------------------------------------- the API's contracts, one case each
@pytest.mark.parametrize("method", ["hooks", "split"])
def test_a_refused_call_counts_no_tokens_and_a_late_one_changes_nothing(method):
    """A call that raised still added its token counts — into the array that *is* ``result.tokens``, so a
    call after the ``with`` block (refused) changed the finished step's counts, and a refused call inside it
    counted tokens whose gradient is in no Gram. Now the counts are added once the call has succeeded."""
    model = make_mlp()
    x = torch.randn(4, 2, 5)
    probe = Probe(model, AGENTS, ROLES, method=method)
    with probe.step(0) as s:
        s.backward_tokens(model(x).sum(-1), (torch.arange(4) % 4)[:, None].expand(4, 2))
        with pytest.raises(ProbeError, match="unknown agent 'nobody'"):
            s.backward({"voter0": model(x).sum()}, tokens={"voter0": 50, "nobody": 1})
        with pytest.raises(ProbeError, match="must be a scalar tensor"):
            s.backward({"voter0": model(x).sum(-1)}, tokens={"voter0": 7})
        if method == "split":  # split cannot split a scalar row loss: refused
            with pytest.raises(ProbeError, match="cannot split a scalar loss"):
                s.backward_rows(model(x).sum(), [0, 1, 2, 3], tokens=[5, 5, 5, 5])
    assert s.result.tokens.tolist() == [2, 2, 2, 2]
    for late in (lambda: s.backward_tokens(model(x).sum(-1), torch.zeros(4, 2, dtype=torch.long)),
                 lambda: s.backward_rows(model(x).sum((1, 2)), [0, 0, 1, 1], tokens=[9, 9, 9, 9]),
                 lambda: s.backward({"aggregator": model(x).sum()}, tokens={"aggregator": 100})):
        with pytest.raises(ProbeError, match="step 0 is not open"):
            late()
    assert s.result.tokens.tolist() == [2, 2, 2, 2] and probe.last.tokens.tolist() == [2, 2, 2, 2]
    probe.close()


@pytest.mark.parametrize("method", ["hooks", "split"])
def test_a_loss_without_gradient_adds_nothing_raises_nothing_and_counts_its_tokens(method):
    """Under split a scalar row loss without gradient raised 'cannot split a scalar loss'; under hooks a
    ``backward({...})`` of such losses was recorded as a split fallback though nothing was back-propagated."""
    model = make_mlp()
    x = torch.randn(4, 2, 5)
    probe = Probe(model, AGENTS, ROLES, method=method)
    with probe.step(0) as s:
        with torch.no_grad():
            s.backward_rows(model(x).sum(), [0, 1, 2, 3], tokens=[1, 2, 3, 4])
            s.backward({"voter0": model(x).sum()}, tokens={"voter0": 10})
            s.backward_tokens(model(x).sum(-1), torch.ones(4, 2, dtype=torch.long))
    probe.close()
    assert s.result.tokens.tolist() == [11, 10, 3, 4]
    assert s.result.method == method and not s.result.gram.any()
    assert all(p.grad is None for p in model.parameters())
    assert getattr(probe._method, "fallback_calls", 0) == 0


def test_malformed_arguments_are_one_line_probe_errors():
    """Each of these raised a TypeError / AttributeError / KeyError from inside the probe, or was taken
    silently (a float agent 1.7 as agent 1; a mixed params list unpacked a 2-row weight as (name, param))."""
    model = make_mlp()
    for groups in (["0.", "2."], 3):
        with pytest.raises(ProbeError, match="groups must be None, one of"):
            Probe(model, AGENTS, ROLES, groups=groups)
    with pytest.raises(ProbeError, match="params must be all .name, parameter. pairs or all parameters"):
        Probe(model, AGENTS, ROLES, params=[("head", model[2].weight), model[0].weight])
    with pytest.raises(ProbeError, match="update_unit must be one of"):
        Probe(model, AGENTS, ROLES, update_unit="bogus")
    probe = Probe(model, AGENTS, ROLES, method="hooks")
    with pytest.raises(ProbeError, match="not a probe state"):
        probe.load_state_dict({})
    x = torch.randn(4, 2, 5)
    with probe.step(0) as s:
        with pytest.raises(ProbeError, match="agent_ids must be a torch.Tensor, got list"):
            s.backward_tokens(model(x).sum(-1), [[0, 0]] * 4)
        with pytest.raises(ProbeError, match="token_loss must be a torch.Tensor"):
            s.backward_tokens(model(x).sum(-1).tolist(), torch.zeros(4, 2, dtype=torch.long))
        for rows in ([0.0, 1.7, 2, 3], np.array([0.0, 1.7, 2.0, 3.0]), [True, 0, 1, 2]):
            with pytest.raises(ProbeError, match="an agent must be a name, an integer index or None"):
                s.backward_rows(model(x).sum((1, 2)), rows)
        s.backward_rows(model(x).sum((1, 2)), np.array([0, 1, 2, 3]))  # numpy integers are indices
        s.backward_rows(model(x).sum((1, 2)), list(torch.tensor([0, 1, 2, 3])))  # and 0-d integer tensors
        with pytest.raises(ProbeError, match="agent_of_row must be integers"):
            s.backward_rows(model(x).sum((1, 2)), list(torch.tensor([0.0, 1.0, 2.0, 3.0])))
        s.backward_rows(model(x).sum((1, 2)) * torch.tensor([1.0, 0.0, 1.0, 1.0]), ["voter0", None, np.int64(2), 3])
    probe.close()
    assert s.result.method == "hooks+check"
    sparse = nn.Sequential(nn.Embedding(11, 6, sparse=True), nn.Linear(6, 5))
    with pytest.raises(ProbeError, match=r"0.weight \(in an Embedding with sparse=True\)"):
        Probe(sparse, AGENTS, ROLES, method="hooks")


@pytest.mark.parametrize("case", ["ghost form", "rows of no agent, one matmul per agent", "bias only"])
def test_grad_is_autograds_bit_for_bit_where_hooks_only_observe(case):
    """Where hooks does not form the weight gradient itself (docs/probe.md, Guarantees), ``.grad`` is autograd's
    bit for bit — biases included: they were the probe's per-row sums, ~5e-7 off."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))
    if case == "ghost form":  # 12 tokens against 64 × 64 weights
        x, ids = torch.randn(4, 3, 64), torch.tensor([0, 1, 2, 0])[:, None].expand(4, 3)
    else:  # products too big to form per row (40 × 64 × 64 > 4 × rows × T × 128): one matmul per agent
        x, ids = torch.randn(40, 3, 64), torch.tensor([0, 1, 2, -1] * 10)[:, None].expand(40, 3)
    params = [(n, p) for n, p in model.named_parameters() if case != "bias only" or n.endswith("bias")]

    def token_loss():
        return (model(x) ** 2).sum(-1) * (ids >= 0)
    token_loss().sum().backward()
    unprobed = [p.grad.clone() for _, p in params]
    terms = {a: token_loss()[ids == k].sum() for k, a in enumerate(AGENTS)}
    expected = brute_force_gram(terms, [p for _, p in params])
    model.zero_grad(set_to_none=True)
    probe = Probe(model, AGENTS, ROLES, method="hooks", params=params)
    with probe.step(0) as s:
        s.backward_tokens(token_loss(), ids)
    probe.close()
    assert all(torch.equal(p.grad, g) for (_, p), g in zip(params, unprobed))
    assert rel_err(s.result.gram, expected) < 1e-5


@pytest.mark.parametrize("bias", [False, True])
def test_which_entries_a_non_finite_row_spoils_with_one_matmul_per_agent(bias):
    """docs/probe.md: with one matmul per agent a non-finite row spoils only its agent's entries of the weight;
    a bias's per-agent sums combine the rows, so a probed bias spoils every entry of its group."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64, bias=bias), nn.Tanh(), nn.Linear(64, 64, bias=bias))
    x = torch.randn(40, 3, 64)
    x[2, 1, 0] = float("nan")  # row 2: agent 2's
    ids = torch.tensor([0, 1, 3, 0] * 10)[:, None].expand(40, 3).clone()
    ids[2::4] = 2
    probe = Probe(model, AGENTS, ROLES, method="hooks", check_every=None)
    with probe.step(0) as s:
        s.backward_tokens((model(x) ** 2).sum(-1), ids)
    probe.close()
    finite = np.isfinite(s.result.gram)
    spoilt = np.zeros((4, 4), bool)
    if bias:
        spoilt[:] = True
    else:
        spoilt[2, :] = spoilt[:, 2] = True
    assert (finite == ~spoilt).all() and s.result.finite is False


def test_a_declared_batch_dim_the_input_lacks_falls_back_to_split():
    torch.manual_seed(0)
    model = make_mlp()
    x, rows = torch.randn(4, 3, 5), [0, 1, 2, 0]
    probe = Probe(model, AGENTS, ROLES, method="hooks")
    with pytest.warns(RuntimeWarning, match=r"layer '0': input of shape \(4, 3, 5\) has no dimension 5 of size B = 4"):
        with probe.step(0) as s:
            with s.rows(rows, batch_dim=5):
                out = model(x)
            s.backward_rows(out.sum((1, 2)), rows)
    probe.close()
    terms = {a: model(x).sum((1, 2))[[r == k for r in rows]].sum() for k, a in enumerate(AGENTS)}
    assert s.result.method == "split-fallback:unmatched-rows"
    assert rel_err(s.result.gram, brute_force_gram(terms, list(model.parameters()))) < 1e-6
