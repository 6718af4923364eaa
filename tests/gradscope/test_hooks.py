"""The hooks probe (one backward, layer hooks) against split and brute force (autograd per agent)."""
from __future__ import annotations

from contextlib import nullcontext

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from gradscope.errors import ProbeError
from gradscope.peft_support import adapter_parameters, use_adapter
from gradscope.probe import Probe
from gradscope.probe import accumulate
from gradscope.probe.rows import Piece
from tests.gradscope.test_probe import AGENTS, ROLES, brute_force_gram, make_mlp, rel_err
from tests.gradscope.tiny_lm import batch, tiny_lora_lm

TOL = {torch.float32: 1e-5, torch.float64: 1e-9}
DTYPES = [torch.float32, torch.float64]
# GHOST_FACTOR settings: never ghost, ghost for the first micro-batch then materialise, always ghost.
GHOST = {"dense": 0.0, "switch": 15.0, "ghost": 1e9}


def run(model, method, calls, groups=None, **kw):
    """One probed step: each call runs its forward(s) (tagged with the step's rows where it tags them)
    and returns (token_loss, agent_ids) for backward_tokens."""
    model.zero_grad(set_to_none=True)
    probe = Probe(model, AGENTS, ROLES, method=method, groups=groups, **kw)
    try:
        with probe.step(0) as s:
            for call in calls:
                s.backward_tokens(*(call(s) if getattr(call, "tags", False) else call()))
    finally:
        probe.close()
    return s.result, probe


def brute(calls, params):
    """Brute-force Gram of the union of the calls' tokens (one autograd.grad per agent)."""
    losses = [call() for call in calls]
    terms = {a: sum(loss[ids == k].sum() for loss, ids in losses) for k, a in enumerate(AGENTS)}
    return brute_force_gram(terms, params)


def grads(model):
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


# ---------------------------------------------------------------- LoRA LMs (SP and IP)
class LMCase:
    """8 rows: voters 0,1,2,0,1,2 (each voter spread over two left-padded sequences), aggregator ×2.

    Each row's first two targets are prompt (agent -1, zero loss); padding is -1 as well. Losses are
    -advantage × log p, normalised by the whole batch's agent tokens, so micro-batches add up.
    """

    ROW_AGENT = torch.tensor([0, 1, 2, 0, 1, 2, 3, 3])

    def __init__(self, model, policy: str, seed: int = 11):
        self.model, self.policy = model, policy
        v_ids, v_mask = batch(6, 12, seed, pad_left=3)
        a_ids, a_mask = batch(2, 12, seed + 100, pad_left=2)
        self.ids, self.mask = torch.cat([v_ids, a_ids]), torch.cat([v_mask, a_mask])
        self.adv = torch.linspace(-1, 1, 8)[:, None]
        agent_ids = self.ROW_AGENT[:, None].expand(8, 11).clone()
        agent_ids[self.mask[:, 1:] == 0] = -1
        agent_ids[:, :2] = -1
        self.agent_ids = agent_ids
        self.n_total = int((agent_ids >= 0).sum())

    def logprobs(self, rows):
        logits = self.model(input_ids=self.ids[rows], attention_mask=self.mask[rows]).logits[:, :-1]
        lp = torch.log_softmax(logits, dim=-1).gather(-1, self.ids[rows, 1:, None])[..., 0]
        return lp * self.mask[rows, 1:]

    def call(self, rows, reverse: bool = False):
        """A micro-batch of rows: one forward (SP) or one forward per role (IP), each tagged with its
        rows' agents (``s.rows``) when a step handle is given; the roles' token losses are concatenated
        in call order, or in the reverse order (``reverse``: tags make that irrelevant)."""
        def forward(s=None):
            if self.policy == "sp":
                lp = self.logprobs(rows)
                order = rows
            else:
                voters, aggs = [r for r in rows if r < 6], [r for r in rows if r >= 6]
                parts = []
                for adapter, part in (("voter", voters), ("aggregator", aggs)):
                    if part:
                        tag = s.rows(self.ROW_AGENT[part]) if s is not None else nullcontext()
                        with use_adapter(self.model, adapter), tag:
                            parts.append((self.logprobs(part), part))
                if reverse:
                    parts.reverse()
                lp, order = torch.cat([p for p, _ in parts]), [r for _, part in parts for r in part]
            ids = self.agent_ids[order]
            return -self.adv[order] * lp * (ids >= 0) / self.n_total, ids
        forward.tags = True
        return forward


def lora_model(policy, dtype):
    return tiny_lora_lm(["shared"] if policy == "sp" else ["voter", "aggregator"], dtype=dtype)


def lora_params(model):
    return [p for ps in adapter_parameters(model).values() for _, p in ps]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp64"])
@pytest.mark.parametrize("policy", ["sp", "ip"])
def test_lora_lm_hooks_equals_split_and_brute_force(policy, dtype):
    model = lora_model(policy, dtype)
    case = LMCase(model, policy)
    calls = [case.call(list(range(8)))]
    expected = brute(calls, lora_params(model))
    model.zero_grad(set_to_none=True)
    calls[0]()[0].sum().backward()  # the unprobed step
    plain = grads(model)

    groups = "adapter" if policy == "ip" else "layer"
    hooks, probe = run(model, "auto", calls, groups=groups)
    assert probe.method_name == "hooks" and probe._method.fallback_calls == 0
    for n, g in grads(model).items():  # one ordinary backward; weight gradients from the per-row products
        assert (g is None) == (plain[n] is None)
        if g is not None:
            torch.testing.assert_close(g, plain[n], rtol=TOL[dtype], atol=TOL[dtype] * float(plain[n].abs().max()))
    split, _ = run(model, "split", calls, groups=groups)
    assert rel_err(hooks.gram, expected) < TOL[dtype]
    assert rel_err(hooks.gram, split.gram) < TOL[dtype]
    assert rel_err(hooks.group_gram, split.group_gram) < TOL[dtype]
    np.testing.assert_allclose(hooks.group_gram.sum(0), hooks.gram, rtol=1e-12, atol=0)
    assert hooks.tokens.tolist() == [int((case.agent_ids == k).sum()) for k in range(4)]
    if policy == "ip":
        assert np.all(hooks.gram[:3, 3] == 0) and np.all(hooks.gram[3, :3] == 0)
    else:
        assert probe.groups == ["layer0", "layer1"] and np.abs(hooks.gram[:3, 3]).min() > 0


@pytest.mark.parametrize("ghost", GHOST)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp64"])
@pytest.mark.parametrize("policy", ["sp", "ip"])
def test_gradient_accumulation_equals_one_big_batch(policy, dtype, ghost, monkeypatch):
    """Two micro-batches in one step; the ghost form must keep the cross-call terms."""
    monkeypatch.setattr(accumulate, "GHOST_FACTOR", GHOST[ghost])
    model = lora_model(policy, dtype)
    case = LMCase(model, policy)
    expected = brute([case.call(list(range(8)))], lora_params(model))
    calls = [case.call([0, 1, 2]), case.call([3, 4, 5, 6, 7])]
    hooks, probe = run(model, "hooks", calls)
    hooks_grads = grads(model)
    split, _ = run(model, "split", calls)
    assert probe._method.fallback_calls == 0
    assert rel_err(hooks.gram, expected) < TOL[dtype]
    assert rel_err(hooks.gram, split.gram) < TOL[dtype]
    for name, g in grads(model).items():
        if g is not None:
            torch.testing.assert_close(hooks_grads[name], g, rtol=1e-5, atol=1e-7)


def test_unprobed_steps_between_do_not_confuse_the_rows():
    model = lora_model("sp", torch.float32)
    case = LMCase(model, "sp")
    probe = Probe(model, AGENTS, ROLES)
    loss, _ = case.call([0, 1, 2])()
    loss.sum().backward()                              # an unprobed step, hooks installed
    with torch.no_grad():
        case.logprobs([4, 5])                          # a no-grad forward (sampling)
    model.zero_grad(set_to_none=True)
    with probe.step(0) as s:
        s.backward_tokens(*case.call(list(range(8)))())
    assert probe._method.fallback_calls == 0
    assert rel_err(s.result.gram, brute([case.call(list(range(8)))], lora_params(model))) < 1e-5


# ---------------------------------------------------------------- gradient checkpointing
def tagged(case: LMCase, rows: list[int]):
    """An SP micro-batch whose forward is tagged with its rows' agents (``s.rows``)."""
    def forward(s):
        with s.rows(case.ROW_AGENT[rows]):
            lp = case.logprobs(rows)
        ids = case.agent_ids[rows]
        return -case.adv[rows] * lp * (ids >= 0) / case.n_total, ids
    forward.tags = True
    return forward


def count_calls(module: nn.Module) -> list[int]:
    """A counter of ``module``'s grad-enabled calls (forwards and a checkpoint's recomputations)."""
    calls = [0]
    module.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + torch.is_grad_enabled()))
    return calls


@pytest.mark.parametrize("tags", [False, True], ids=["untagged", "s.rows"])
def test_gradient_checkpointing_is_exact_and_passes_the_self_check(tags):
    """HF gradient checkpointing (torch.utils.checkpoint, non-reentrant): the decoder layers run again
    inside every backward (the self-check's too). Those recomputations are not new forwards; hooks equals
    brute force (autograd per agent, no checkpointing), with the self-check on and agreeing, over two
    micro-batches. (One adapter: a checkpoint recomputes with the adapter active at backward time.)"""
    model = lora_model("sp", torch.float64)
    case = LMCase(model, "sp")
    expected = brute([case.call(list(range(8)))], lora_params(model))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()  # HF checkpoints only in training mode (dropout is 0 throughout)
    calls = count_calls(model.get_submodule("base_model.model.model.layers.0.self_attn.q_proj.lora_A.shared"))
    micro = [tagged(case, rows) if tags else case.call(rows) for rows in ([0, 1, 2, 6], [3, 4, 5, 7])]
    result, probe = run(model, "hooks", micro)
    assert calls[0] > 2  # checkpointing was on: the layer ran again in the backwards
    assert result.method == "hooks+check" and probe._method.fallback_calls == 0 and not result.warnings
    assert rel_err(result.gram, expected) < TOL[torch.float64]


def test_reentrant_checkpointing_is_not_attributed_by_hooks():
    """Reentrant checkpointing runs the layers without grad and back-propagates through their recomputation
    only: hooks sees no call to attribute; the call goes through split (exact), saying why."""
    model = lora_model("sp", torch.float64)
    case = LMCase(model, "sp")
    expected = brute([case.call(list(range(8)))], lora_params(model))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.enable_input_require_grads()  # reentrant checkpointing needs an input that requires grad
    model.train()
    with pytest.warns(RuntimeWarning, match="use_reentrant=False"):
        result, _ = run(model, "auto", [case.call(list(range(8)))])
    assert result.method == "split-fallback:unmatched-rows"
    assert rel_err(result.gram, expected) < TOL[torch.float64]

    # a hooked layer seen with grad before the checkpoint: the backward reaches the recomputed ones
    torch.manual_seed(0)
    first, second = nn.Linear(3, 4).double(), nn.Linear(4, 2).double()
    model = nn.ModuleDict({"first": first, "second": second})
    x = torch.randn(4, 3, dtype=torch.float64)
    probe = Probe(model, AGENTS, ROLES, method="hooks")
    with pytest.raises(ProbeError, match="reentrant gradient checkpointing"), probe.step(0) as s:
        out = torch.utils.checkpoint.checkpoint(second, first(x), use_reentrant=True)
        s.backward_rows(out.square().sum(1), torch.arange(4))


# ---------------------------------------------------------------- a fully trained Embedding + Linear head
class EmbedLM(nn.Module):
    """Embedding (padding_idx 0) → causal running mean over positions (mixes a row) → tanh → Linear head."""

    def __init__(self, vocab: int = 23, dim: int = 16, dtype=torch.float32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(vocab, dim, padding_idx=0, dtype=dtype)
        self.head = nn.Linear(dim, vocab, dtype=dtype)

    def forward(self, ids):
        h = self.emb(ids).cumsum(1) / torch.arange(1, ids.shape[1] + 1, dtype=self.head.weight.dtype)[:, None]
        return self.head(torch.tanh(h))


def embed_case(model, n: int = 8, seed: int = 5, mix_row: bool = False):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 23, (n, 10), generator=g)
    ids[::3, :3] = 0  # left padding
    row_agent = torch.tensor([0, 1, 2, 3, 0, 1, 2, -1])[:n]  # row 7: no agent, zero loss
    agent_ids = row_agent[:, None].expand(n, 9).clone()
    agent_ids[ids[:, 1:] == 0] = -1
    if mix_row:
        agent_ids[1, 6:] = 2  # row 1 holds tokens of agents 1 and 2
    adv = torch.linspace(-1, 1, n, dtype=model.head.weight.dtype)[:, None]

    def call(rows=slice(None)):
        def forward():
            logits = model(ids[rows])[:, :-1]
            lp = torch.log_softmax(logits, -1).gather(-1, ids[rows, 1:, None])[..., 0]
            return -adv[rows] * lp * (agent_ids[rows] >= 0) / 50, agent_ids[rows]
        return forward
    return call


@pytest.mark.parametrize("ghost", GHOST)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp64"])
def test_trained_embedding_and_head(dtype, ghost, monkeypatch):
    monkeypatch.setattr(accumulate, "GHOST_FACTOR", GHOST[ghost])
    model = EmbedLM(dtype=dtype)
    call = embed_case(model)
    params = list(model.parameters())
    expected = brute([call()], params)
    groups = {"emb": ["emb."], "head": ["head."]}
    one, probe = run(model, "auto", [call()], groups=groups)
    acc, _ = run(model, "auto", [call(slice(0, 3)), call(slice(3, 8))], groups=groups)
    split, _ = run(model, "split", [call()], groups=groups)
    assert probe.method_name == "hooks"
    for result in (one, acc):
        assert rel_err(result.gram, expected) < TOL[dtype]
        assert rel_err(result.group_gram, split.group_gram) < TOL[dtype]
    assert model.emb.weight.grad[0].abs().max() == 0  # padding_idx: no gradient, none attributed


@pytest.mark.parametrize("order", ["tokens-then-dict", "dict-then-tokens"])
def test_dict_calls_and_mixed_rows_fall_back_to_split_within_the_step(order, monkeypatch):
    """backward({agent: loss}) and rows mixing agents go through split; they mix with hooks calls."""
    monkeypatch.setattr(accumulate, "GHOST_FACTOR", 1e9)  # the head in ghost form, then materialised
    model = EmbedLM(dtype=torch.float64)
    call = embed_case(model)
    params = list(model.parameters())
    expected = brute([call()], params)
    probe = Probe(model, AGENTS, ROLES, method="hooks")

    def as_dict():
        loss, ids = call(slice(3, 8))()
        return {a: loss[ids == k].sum() for k, a in enumerate(AGENTS)}
    with probe.step(0) as s:
        if order == "tokens-then-dict":
            s.backward_tokens(*call(slice(0, 3))())
            s.backward(as_dict())
        else:
            s.backward(as_dict())
            s.backward_tokens(*call(slice(0, 3))())
    assert probe._method.fallback_calls > 0
    assert rel_err(s.result.gram, expected) < 1e-9
    plain = EmbedLM(dtype=torch.float64)
    embed_case(plain)()()[0].sum().backward()
    for p, q in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-15)

    mixed = embed_case(model, mix_row=True)()
    model.zero_grad(set_to_none=True)
    probe._method.fallback_calls = 0
    with probe.step(1) as s:
        s.backward_tokens(*mixed())
    assert probe._method.fallback_calls > 0
    assert rel_err(s.result.gram, brute([mixed], params)) < 1e-9


def test_per_agent_buffers_reused_across_steps_start_from_the_step_s_first_call():
    """The per-row path writes a parameter's first call of a step straight into its per-agent buffer (kept
    from the previous step, not zeroed): each step's Gram is that step's brute force, with the agents' rows
    placed differently each step, an agent absent, rows of no agent, and a second call adding to the first."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4, bias=False), nn.Tanh(), nn.Linear(4, 3, bias=False)).double()
    probe = Probe(model, AGENTS, ROLES, method="hooks")
    try:
        for step, rows_agents in enumerate([[0, 1, 2, 3, 0, 1], [3, 3, 1, -1, 1, 0], [2, 0, 2, 0, -1, -1]]):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(6, 5, 6, generator=g, dtype=torch.float64)
            agent_ids = torch.tensor(rows_agents)[:, None].expand(6, 5)

            def call(rows, x=x, agent_ids=agent_ids):
                def forward():
                    return model(x[rows]).square().mean(-1) * (agent_ids[rows] >= 0), agent_ids[rows]
                return forward
            calls = [call(slice(0, 4)), call(slice(4, 6))]
            expected = brute(calls, list(model.parameters()))
            with probe.step(step) as s:
                for c in calls:
                    s.backward_tokens(*c())
            assert s.result.method.startswith("hooks") and rel_err(s.result.gram, expected) < 1e-9, step
    finally:
        probe.close()


@pytest.mark.parametrize("n_calls", [1, 2])
def test_the_add_up_check_s_magnitude_is_the_norms_of_each_call_s_per_agent_sums(n_calls):
    """Unchecked per-row steps: a weight's magnitude S (the scale of the add-up check's rounding allowance) is
    Σ_calls Σ_k ‖S_k‖, S_k agent k's part of a call's gradient (autograd per call and agent). A weight's first
    call leaves its norms to be read from its buffer: at ``end``, or before a second call adds to it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4, bias=False), nn.Tanh(), nn.Linear(4, 3, bias=False)).double()
    weights = [model[0].weight, model[2].weight]
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(4, 5, 6, generator=g, dtype=torch.float64) for _ in range(n_calls)]
    agent_ids = [torch.tensor(rows)[:, None].expand(4, 5) for rows in ([0, 1, 2, 0], [2, 2, 3, 1])[:n_calls]]
    expected = np.zeros(2)
    for x, ids in zip(xs, agent_ids):
        loss = model(x).square().mean(-1)
        for k in range(4):
            if (ids == k).any():
                parts = torch.autograd.grad(loss[ids == k].sum(), weights, retain_graph=True)
                expected += [float(part.norm()) for part in parts]
    probe = Probe(model, AGENTS, ROLES, method="hooks", check_every=None)
    method, seen = probe._method, []
    resolve = method.acc.magnitudes
    method.acc.magnitudes = lambda: seen.append(resolve()) or seen[-1]
    try:
        with probe.step(0) as s:
            for x, ids in zip(xs, agent_ids):
                s.backward_tokens(model(x).square().mean(-1), ids)
    finally:
        probe.close()
    assert s.result.method == "hooks" and seen
    index = [next(i for i, p in enumerate(method.params) if p is w) for w in weights]
    assert np.allclose([seen[0][i] for i in index], expected, rtol=1e-9)


@pytest.mark.parametrize("products", ["per-row", "per-agent"])
@pytest.mark.parametrize("last_row", [2, -1], ids=["owned", "unowned"])
@pytest.mark.parametrize("ghost", GHOST)
def test_mlp_on_2d_inputs_with_biases(ghost, last_row, products, monkeypatch):
    """Rows are samples (no token axis): Linear inputs (n, d); token_loss is (n, 1). Dense products per row or
    per agent over its rows, with or without a row of no agent: the Gram is brute force's and .grad the
    unprobed step's (the weight gradient then comes from those products, or from autograd)."""
    monkeypatch.setattr(accumulate, "GHOST_FACTOR", GHOST[ghost])
    if products == "per-agent":
        monkeypatch.setattr(accumulate, "_per_row", lambda *a: False)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3)).double()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(12, 5, generator=g, dtype=torch.float64), torch.randn(12, 3, generator=g, dtype=torch.float64)
    agent_ids = torch.tensor([0, 1, 2, 3, 2, 1, 0, 0, 1, 3, 2, last_row])[:, None]

    def call(rows):
        def forward():
            loss = ((model(x[rows]) - y[rows]) ** 2).sum(1, keepdim=True) * (agent_ids[rows] >= 0) / 12
            return loss, agent_ids[rows]
        return forward
    expected = brute([call(slice(None))], list(model.parameters()))
    model.zero_grad(set_to_none=True)
    for rows in (slice(0, 5), slice(5, 12)):
        call(rows)()[0].sum().backward()
    plain = grads(model)
    result, probe = run(model, "auto", [call(slice(0, 5)), call(slice(5, 12))])
    assert probe.method_name == "hooks" and probe._method.fallback_calls == 0
    assert rel_err(result.gram, expected) < 1e-9
    for n, grad in grads(model).items():
        torch.testing.assert_close(grad, plain[n], rtol=1e-12, atol=1e-12 * float(plain[n].abs().max()))


def test_autocast_bf16_inputs_and_gradients_of_different_dtypes():
    """Under CPU autocast a Linear's input is fp32 (the first layer) or bf16 and its output gradient bf16:
    hooks casts each to the probe's dtype. Brute force runs under the same autocast (bf16 rounding: 2e-2)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
    agent_ids = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])[:, None]

    def call():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        return ((out.float() - y) ** 2).sum(1, keepdim=True) / 8, agent_ids
    expected = brute([call], list(model.parameters()))
    result, probe = run(model, "hooks", [call])
    assert result.method.startswith("hooks")
    assert rel_err(result.gram, expected) < 2e-2


# ---------------------------------------------------------------- guarantees and refusals
def test_nonfinite_measured_failed_step_and_existing_grad():
    model, plain = EmbedLM(), EmbedLM()
    call, plain_call = embed_case(model)(), embed_case(plain)()
    probe = Probe(model, AGENTS, ROLES)

    def nan_row(c):
        loss, ids = c()
        return loss * torch.where(torch.arange(8)[:, None] == 1, float("nan"), 1.0), ids
    with probe.step(0) as s:
        s.backward_tokens(*nan_row(call))
    assert not s.result.finite
    nan_row(plain_call)[0].sum().backward()
    for p, q in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, equal_nan=True)

    for m in (model, plain):
        for p in m.parameters():
            p.grad = torch.full_like(p, 0.25)  # kept, and the add-up check must not misfire
    with pytest.raises(RuntimeError, match="boom"):
        with probe.step(1) as s:
            s.backward_tokens(*call())
            raise RuntimeError("boom")
    plain_call()[0].sum().backward()
    for p, q in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    with probe.step(2) as s:
        s.backward_tokens(*call())
    assert s.result.finite and s.result.gram[0, 0] > 0


def test_uncovered_parameters_refused_or_split():
    model = nn.Sequential(nn.Linear(5, 8), nn.LayerNorm(8), nn.Linear(8, 3))
    with pytest.raises(ProbeError, match=r"not: 1\.weight \(in a LayerNorm\), 1\.bias \(in a LayerNorm\)\. "
                                         "Use method='split'"):
        Probe(model, AGENTS, ROLES, method="hooks")
    assert Probe(model, AGENTS, ROLES).method_name == "split"
    model[1].requires_grad_(False)
    assert Probe(model, AGENTS, ROLES).method_name == "hooks"

    mha = nn.MultiheadAttention(8, 2)  # out_proj is a Linear subclass used without its forward
    assert Probe(mha, AGENTS, ROLES).method_name == "split"
    tied = nn.Sequential(nn.Embedding(7, 4), nn.Linear(4, 7, bias=False))
    tied[1].weight = tied[0].weight
    assert Probe(tied, AGENTS, ROLES).method_name == "split"
    with pytest.raises(ProbeError, match=r"not: 0\.weight \(tied: held by 2 modules, '0', '1'\)"):
        Probe(tied, AGENTS, ROLES, method="hooks")  # an Embedding's weight, refused for being tied
    with pytest.raises(ProbeError, match="needs the model"):
        Probe(None, AGENTS, ROLES, params=list(model.parameters()), method="hooks")
    assert Probe(None, AGENTS, ROLES, params=list(model.parameters())).method_name == "split"


def test_grad_reduced_when_the_framework_changes_grad():
    """grad_reduced=True: .grad is not this rank's own gradient (here a hook halves it after accumulation,
    as a data-parallel average would). The add-up check, which compares with .grad, would call the
    measurement wrong; with the option the probe skips it, its self-check still runs and agrees, and the
    Gram is brute force's. A call hooks cannot attribute raises (split would read .grad), and so does a
    method other than hooks."""
    model = lora_model("sp", torch.float64)
    case = LMCase(model, "sp")
    call = case.call(list(range(8)))
    expected = brute([call], lora_params(model))
    def average(p: torch.Tensor) -> None:
        p.grad.mul_(0.5)
    for p in lora_params(model):
        p.register_post_accumulate_grad_hook(average)
    with pytest.raises(ProbeError, match="do not add up"):
        run(model, "hooks", [call])
    result, probe = run(model, "hooks", [call], grad_reduced=True)
    assert result.method == "hooks+check" and probe._method.fallback_calls == 0
    assert rel_err(result.gram, expected) < TOL[torch.float64]

    def untagged():  # two untagged forwards: auto would fall back to split
        lp = torch.cat([case.logprobs([0, 1, 2]), case.logprobs([3, 4, 5, 6, 7])])
        ids = case.agent_ids
        return -case.adv * lp * (ids >= 0) / case.n_total, ids
    with pytest.raises(ProbeError, match="without row tags.*grad_reduced=True"):
        run(model, "auto", [untagged], grad_reduced=True)
    with pytest.raises(ProbeError, match="grad_reduced=True needs the hooks method"):
        Probe(model, AGENTS, ROLES, method="split", grad_reduced=True)
    with pytest.raises(ProbeError, match="grad_reduced=True needs the hooks method.*auto"):
        Probe(nn.Sequential(nn.Linear(5, 8), nn.LayerNorm(8)), AGENTS, ROLES, grad_reduced=True)


class Leaky(nn.Module):
    """A Linear whose weight is also used outside the layer (scaled by ``leak``): invisible to hooks."""

    def __init__(self, leak: float = 1.0, width: int = 4):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.leak = leak

    def forward(self, x):
        return self.lin(x) + self.leak * F.linear(x.flip(-1), self.lin.weight)


@pytest.mark.parametrize("leak", [1.0, 0.1])
def test_weight_used_outside_its_layer_is_caught(leak):
    """Also a use that carries ~10% of the gradient: the add-up check keeps its power in fp32."""
    torch.manual_seed(0)
    model = Leaky(leak)
    x = torch.randn(4, 3, 4)
    probe = Probe(model, AGENTS, ROLES, method="hooks")
    with pytest.raises(ProbeError, match="do not add up"):
        with probe.step(0) as s:
            s.backward_tokens(model(x).sum(-1), torch.arange(4)[:, None].expand(4, 3))


class ReadOnly(nn.Module):
    """A Linear never called: its weight is read (as peft's target_parameters LoRA reads its lora_A / lora_B)."""

    def __init__(self):
        super().__init__()
        self.lin, self.out = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.out(F.linear(x, self.lin.weight))


def test_a_layer_never_called_whose_weight_moves_is_named():
    torch.manual_seed(0)
    model = ReadOnly()
    probe = Probe(model, AGENTS, ROLES, method="hooks")
    with pytest.raises(ProbeError, match=r"outside its layer's forward \(layer 'lin': gradient, but no call of it that a backward reached\)"):
        with probe.step(0) as s:
            s.backward_tokens(model(torch.randn(4, 3, 4)).sum(-1), torch.arange(4)[:, None].expand(4, 3))


def test_peft_target_parameters_lora_is_left_to_split():
    """peft's LoRA on fused MoE experts (target_parameters) reads its lora_A / lora_B Linears' weights without
    calling them: auto chose hooks and every step failed the add-up check; now auto measures them by split
    (right Gram) and hooks refuses them, saying why."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, MixtralConfig

    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=16, num_local_experts=4,
                           num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    model = get_peft_model(AutoModelForCausalLM.from_config(config),  # (fp32: grouped_mm has no fp64)
                           LoraConfig(r=2, target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj"],
                                      init_lora_weights=False))
    params = [p for p in model.parameters() if p.requires_grad]
    with pytest.raises(ProbeError, match=r"experts\.lora_A.*target_parameters LoRA \(ParamWrapper\) never calls"):
        Probe(model, AGENTS, ROLES, method="hooks")
    ids = torch.randint(0, 64, (4, 6), generator=torch.Generator().manual_seed(1))
    agent_ids = torch.arange(4)[:, None].expand(4, 5)

    def token_loss():
        logp = torch.log_softmax(model(input_ids=ids).logits[:, :-1], -1)
        return logp.gather(-1, ids[:, 1:, None])[..., 0] * torch.tensor([1.0, -0.5, 0.8, 0.3])[:, None]
    want = brute_force_gram({a: token_loss()[agent_ids == k].sum() for k, a in enumerate(AGENTS)}, params)
    model.zero_grad(set_to_none=True)
    probe = Probe(model, AGENTS, ROLES)
    try:
        with probe.step(0) as s:
            s.backward_tokens(token_loss(), agent_ids)
    finally:
        probe.close()
    assert probe.method_name == "split" and rel_err(s.result.gram, want) < 1e-5


def test_a_call_the_loss_does_not_reach_needs_no_batch_dimension():
    """peft's DoRA calls lora_A on eye(d_in) for its weight norm, which it detaches: that call has no dimension of
    size B but gets no gradient either. Probing the LoRA factors only (magnitudes frozen), every step fell back
    to split for it; now hooks, with the right Gram."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Qwen3Config

    from tests.gradscope.tiny_lm import token_logprobs

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8, tie_word_embeddings=False)
    model = get_peft_model(AutoModelForCausalLM.from_config(config).double(),
                           LoraConfig(r=2, target_modules=["q_proj", "down_proj"], use_dora=True,
                                      init_lora_weights=False)).eval()
    named = [(n, p) for n, p in model.named_parameters() if "lora_A" in n or "lora_B" in n]
    for name, p in model.named_parameters():
        p.requires_grad_("lora_A" in name or "lora_B" in name)
    params = [p for _, p in named]
    probe = Probe(model, AGENTS, ROLES, params=named)
    try:
        for step in range(2):
            ids, mask = batch(4, 6, seed=step)
            adv = torch.tensor([1.0, -0.5, 0.8, 0.3], dtype=torch.float64)[:, None]
            agent_ids = torch.arange(4)[:, None].expand(4, 5)
            want = brute_force_gram({a: (adv * token_logprobs(model, ids, mask))[agent_ids == k].sum()
                                     for k, a in enumerate(AGENTS)}, params)
            model.zero_grad(set_to_none=True)
            with probe.step(step) as s:
                s.backward_tokens(adv * token_logprobs(model, ids, mask), agent_ids)
            assert s.result.method == ("hooks+check", "hooks")[step] and rel_err(s.result.gram, want) < 1e-10
    finally:
        probe.close()


def test_an_auxiliary_backward_inside_the_step_is_named_as_a_cause():
    """A regulariser's own .backward() inside the probed step adds gradient that belongs to no agent: the
    add-up check fails, and its error names that cause (it blamed only a weight used outside its layer)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2))
    x, aux = torch.randn(4, 5), torch.randn(4, 5)
    probe = Probe(model, AGENTS, ROLES, method="hooks")
    with pytest.raises(ProbeError, match=r"do not add up.*a backward outside the probe \(.backward\(\)"):
        with probe.step(0) as s:
            model(aux).square().mean().mul(0.1).backward()
            s.backward_rows(model(x).square().sum(1), torch.arange(4))


class KeywordCalls(nn.Module):
    """Calls its layers by keyword, as nn.Linear.forward(input) and nn.Embedding.forward(input) allow."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = nn.Embedding(10, 6), nn.Linear(6, 3)

    def forward(self, ids):
        return self.head(input=torch.tanh(self.embed(input=ids)))


class InPlaceResidual(nn.Module):
    """``x += layer(x)``: legal when the layer's weight is frozen (F.linear then keeps no input)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second = nn.Linear(6, 6), nn.Linear(6, 2)

    def forward(self, ids):
        x = F.one_hot(ids, 6).float()
        x += self.first(x)
        return self.second(torch.tanh(x))


@pytest.mark.parametrize("model_of", [KeywordCalls, InPlaceResidual], ids=["keyword-calls", "bitfit-in-place"])
def test_models_that_run_unprobed_run_probed(model_of):
    """Layers called by keyword, and BitFit (biases only) with an in-place residual: both ran unprobed but
    failed under the probe (a TypeError / IndexError; autograd's in-place error, from the input the
    hooked Linear kept for a frozen weight). Now exact."""
    model = model_of()
    if model_of is InPlaceResidual:
        for name, p in model.named_parameters():
            p.requires_grad_("bias" in name)
    params = [p for p in model.parameters() if p.requires_grad]
    ids = torch.randint(0, 6, (4, 3), generator=torch.Generator().manual_seed(1))
    rows = torch.arange(4)

    def loss():
        return model(ids).square().sum((1, 2))
    expected = brute_force_gram({a: loss()[rows == k].sum() for k, a in enumerate(AGENTS)}, params)
    probe = Probe(model, AGENTS, ROLES, method="hooks")
    try:
        with probe.step(0) as s:
            s.backward_rows(loss(), rows)
    finally:
        probe.close()
    assert s.result.method == "hooks+check" and rel_err(s.result.gram, expected) < 1e-5


@pytest.mark.parametrize("when", ["before-forward", "before-backward"])
@pytest.mark.parametrize("frozen", ["0.weight", "2.", "0.bias"])
def test_a_parameter_frozen_between_steps_gets_no_per_agent_gradient(frozen, when):
    """requires_grad_(False) on a probed parameter after the probe was built, before the step's forward or
    between it and the backward (AccumulateGrad then drops the gradient): it gets no .grad, so hooks must
    not attribute one (the add-up check failed, blaming a weight used outside its layer)."""
    model = make_mlp().double()
    x = torch.randn(4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    rows = torch.arange(4)
    probe = Probe(model, AGENTS, ROLES, method="hooks")

    def freeze(step):
        for name, p in model.named_parameters():
            p.requires_grad_(step == 0 or not name.startswith(frozen))
    try:
        for step in range(2):
            freeze(step)
            trained = [p for p in model.parameters() if p.requires_grad]
            expected = brute_force_gram({a: model(x).square().sum(1)[rows == k].sum() for k, a in enumerate(AGENTS)},
                                        trained)
            model.zero_grad(set_to_none=True)
            freeze(0 if when == "before-backward" else step)
            with probe.step(step) as s:
                loss = model(x).square().sum(1)
                freeze(step)
                s.backward_rows(loss, rows)
            assert s.result.method.startswith("hooks") and rel_err(s.result.gram, expected) < 1e-10
            assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
    finally:
        probe.close()


def test_a_sparse_embedding_is_measured_by_split():
    """nn.Embedding(sparse=True) has sparse gradients, which hooks does not attribute: auto picks split,
    which crashed on them (reshape of a sparse tensor). Its Gram equals a dense twin's."""
    grams = []
    for sparse in (True, False):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(10, 4, sparse=sparse), nn.Linear(4, 2))
        probe = Probe(model, AGENTS, ROLES)
        ids = torch.randint(0, 10, (4, 3), generator=torch.Generator().manual_seed(1))
        try:
            with probe.step(0) as s:
                s.backward_rows(model(ids).square().sum((1, 2)), torch.arange(4))
        finally:
            probe.close()
        assert s.result.method == ("split" if sparse else "hooks+check")
        grams.append(s.result.gram)
    assert model[0].weight.grad is not None and rel_err(grams[0], grams[1]) < 1e-6


def test_an_input_buffer_reused_between_micro_batches_keeps_the_kept_rows(monkeypatch):
    """Gradient accumulation that copies each micro-batch into one input buffer (legal: the previous graph
    is gone). A weight in ghost form keeps its input rows until the step ends; they were a view of that
    buffer, so the next copy overwrote them (the add-up check then blamed a weight used outside its layer)."""
    monkeypatch.setattr(accumulate, "GHOST_FACTOR", GHOST["ghost"])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 2))
    xs = [torch.randn(4, 32) for _ in range(2)]
    rows = torch.arange(4)
    losses = [model(x).square().sum(1) for x in xs]
    expected = brute_force_gram({a: sum(loss[rows == k].sum() for loss in losses) for k, a in enumerate(AGENTS)},
                                list(model.parameters()))
    buffer = torch.empty(4, 32)
    probe = Probe(model, AGENTS, ROLES, method="hooks")
    try:
        for step in range(2):  # the first step is checked, the second is not
            model.zero_grad(set_to_none=True)
            with probe.step(step) as s:
                for x in xs:
                    buffer.copy_(x)
                    s.backward_rows(model(buffer).square().sum(1), rows)
            assert rel_err(s.result.gram, expected) < 1e-5
    finally:
        probe.close()


@pytest.mark.parametrize("ghost", GHOST)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp64"])
@pytest.mark.parametrize("advantages", ["cancel", "cancel-one-agent", "zero"])
def test_cancelling_rows_and_zero_gradients_pass_the_add_up_check(advantages, dtype, ghost, monkeypatch):
    """GRPO with groups of two: an agent's two identical rollouts with advantages ±a have a gradient that
    is only rounding noise. Hooks and autograd round differently (hooks' per-row terms cancel exactly);
    the check must allow rounding relative to the cancelled terms (this failed `train --tasks-per-step 2
    --group-size 2` at step 2 before). The Gram is then zero to rounding, as split's."""
    monkeypatch.setattr(accumulate, "GHOST_FACTOR", GHOST[ghost])
    model = lora_model("sp", dtype)
    ids, mask = batch(8, 12, seed=3, pad_left=2)
    ids[1::2], mask[1::2] = ids[::2], mask[::2]  # rows 2j and 2j+1 identical
    row_agent = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    adv = {"cancel": [1.0, -1.0] * 4, "cancel-one-agent": [0.7, -0.7, 0, 0, 0, 0, 0, 0],
           "zero": [0.0] * 8}[advantages]
    adv = torch.tensor(adv, dtype=dtype)[:, None]

    def call():
        lp = case_logprobs(model, ids, mask)
        agent_ids = row_agent[:, None].expand_as(lp).clone()
        agent_ids[mask[:, 1:] == 0] = -1
        return -adv * lp * (agent_ids >= 0) / 80, agent_ids
    hooks, probe = run(model, "hooks", [call])
    assert probe._method.fallback_calls == 0
    total = sum(float(p.grad.double().square().sum()) for p in lora_params(model) if p.grad is not None)
    split, _ = run(model, "split", [call])
    assert np.abs(hooks.gram).max() <= max(total, np.abs(split.gram).max()) * 10 + 1e-300
    per_row = torch.autograd.grad(-(case_logprobs(model, ids[:1], mask[:1])).sum() / 80, lora_params(model))
    row_sq = sum(float(g.double().square().sum()) for g in per_row)  # one row's gradient, squared
    assert total < TOL[dtype] ** 2 * row_sq  # the step's gradient is rounding noise indeed


def case_logprobs(model, ids, mask):
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
    return torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None])[..., 0] * mask[:, 1:]


# ---------------------------------------------------------------- the weight gradient from the per-row products
def test_weight_gradients_come_from_the_per_row_products_and_close_restores_the_layers():
    """While attached, a hooked nn.Linear's backward takes its weight gradient from the probe's per-row products
    (autograd's own weight gradient is not computed): .grad matches the unprobed step, the Gram brute force;
    close() gives the layers back their class forward; a forward replaced on the instance before is kept."""
    from gradscope.probe import fused

    model = lora_model("sp", torch.float32)
    case = LMCase(model, "sp")
    calls = [case.call(list(range(8)))]
    expected = brute(calls, lora_params(model))
    model.zero_grad(set_to_none=True)
    calls[0]()[0].sum().backward()
    plain = grads(model)

    linears = [m for m in model.modules() if type(m) is nn.Linear and m.weight.requires_grad]
    own = linears[0]
    own.forward = lambda x, _m=own: F.linear(x, _m.weight, _m.bias)  # e.g. accelerate's device hook
    model.zero_grad(set_to_none=True)
    probe = Probe(model, AGENTS, ROLES)
    # an installed forward reports its calls itself; the layer whose forward was replaced keeps a forward hook
    assert all(not m._forward_hooks for m in linears[1:]) and len(own._forward_hooks) == 1
    seen = []
    with probe.step(0) as s:
        out = None
        for m in linears:  # which calls run HookedLinear, seen through the outputs
            m.register_forward_hook(lambda mod, a, o: seen.append((mod, fused.is_hooked(o))))
        loss, ids = calls[0]()
        s.backward_tokens(loss, ids)
    hooked = dict(seen)
    assert hooked[own] is False and all(hooked[m] for m in linears[1:])
    assert rel_err(s.result.gram, expected) < TOL[torch.float32]
    for n, g in grads(model).items():
        if g is not None:
            torch.testing.assert_close(g, plain[n], rtol=1e-5, atol=1e-5 * float(plain[n].abs().max()))
    probe.close()
    assert all("forward" not in vars(m) for m in linears[1:]) and "forward" in vars(own)
    for m in linears:
        m._forward_hooks.clear()
    with torch.no_grad():
        x = torch.randn(3, linears[1].in_features)
        assert torch.equal(linears[1](x), F.linear(x, linears[1].weight, linears[1].bias))


def test_bf16_model_weight_gradients_and_gram():
    """A bf16 model (no autocast): the per-row products are formed in fp32 and the weight gradient cast back to
    bf16; .grad matches the unprobed bf16 step and the Gram split's to 16-bit rounding."""
    model = tiny_lora_lm(["shared"]).to(torch.bfloat16)  # adapters too (peft keeps them fp32 otherwise)
    case = LMCase(model, "sp")
    calls = [case.call(list(range(8)))]
    model.zero_grad(set_to_none=True)
    calls[0]()[0].float().sum().backward()
    plain = grads(model)
    hooks, probe = run(model, "hooks", calls)
    assert probe._method.fallback_calls == 0
    params = dict(model.named_parameters())
    assert {params[n].dtype for n, g in grads(model).items() if g is not None} == {torch.bfloat16}
    for n, g in grads(model).items():
        if g is not None:
            assert g.dtype == params[n].dtype
            torch.testing.assert_close(g.float(), plain[n].float(), rtol=3e-2, atol=3e-2 * float(plain[n].abs().max()))
    split, _ = run(model, "split", calls)
    assert rel_err(hooks.gram, split.gram) < 3e-2


def test_a_backward_with_create_graph_through_hooked_layers_stays_differentiable():
    """While a probe is attached its layers run HookedLinear: a backward(create_graph=True) of the user's own (a
    gradient penalty, outside the probe's calls) still gives a differentiable .grad with the unprobed
    second-order gradient."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 1)).double()
    x = torch.randn(8, 4, dtype=torch.float64)

    def second_order():
        model.zero_grad(set_to_none=True)
        model(x).square().sum().backward(create_graph=True)
        w = model[0].weight
        assert w.grad.requires_grad
        return torch.autograd.grad(w.grad.square().sum(), w)[0]

    plain = second_order()
    probe = Probe(model, AGENTS, ROLES, method="hooks")
    try:
        from gradscope.probe import fused
        assert fused.is_hooked(model[0](x))
        probed = second_order()
    finally:
        probe.close()
    torch.testing.assert_close(probed, plain)


@pytest.mark.parametrize("tiny", ["all", "one"])
@pytest.mark.parametrize("form", ["dense", "ghost", "embedding", "sketch"])
def test_vanishing_gradients_neither_underflow_the_gram_nor_fail_the_add_up_check(form, tiny, monkeypatch):
    """Gradient entries ~1e-25 (every agent's, or one agent's beside O(1) ones): their fp32 squares underflow to
    zero. The Gram must still be split's (float64), diagonal included, and the add-up check (float64 ‖Δ.grad‖²)
    must not take the underflowed Gram for a weight used elsewhere."""
    monkeypatch.setattr(accumulate, "GHOST_FACTOR", GHOST["ghost" if form == "ghost" else "dense"])
    torch.manual_seed(0)
    embed = [nn.Embedding(50, 16)] if form == "embedding" else []
    model = nn.Sequential(*embed, *[nn.Linear(16, 16) for _ in range(3)])
    x = torch.randint(0, 50, (8, 4)) if embed else torch.randn(8, 4, 16)
    agent_ids = (torch.arange(8) % 4)[:, None].expand(8, 4)
    grams = {}
    for method in ("hooks", "split"):
        model.zero_grad(set_to_none=True)
        probe = Probe(model, AGENTS, ROLES, method=method, sketch=32 if form == "sketch" else None)
        with probe.step(0) as s:
            scale = torch.where(agent_ids == 1, 1e-25, 1.0) if tiny == "one" else 1e-25
            s.backward_tokens(model(x).square().mean(-1) * scale, agent_ids)
        probe.close()
        grams[method] = s.result.gram
    assert 0 < np.diagonal(grams["split"])[1] < 1e-40
    if form != "sketch":  # (a sketch estimates the Gram; it must only not fail)
        assert rel_err(grams["hooks"], grams["split"]) < 1e-5
        np.testing.assert_allclose(np.diagonal(grams["hooks"]), np.diagonal(grams["split"]), rtol=1e-5, atol=0)


@pytest.mark.parametrize("check_every", [None, 0])
def test_tagged_forward_with_rows_of_several_agents_goes_to_split(check_every):
    """A forward tagged with one agent per row (e.g. the largest agent id of the row's tokens, as an
    integration might) whose loss has a row holding two agents' tokens: hooks cannot split that row, so
    the call goes to split — also without the self-check, which would otherwise not be there to catch it."""
    model = EmbedLM(dtype=torch.float64)
    params = list(model.parameters())
    mixed = embed_case(model, mix_row=True)()
    expected = brute([mixed], params)
    model.zero_grad(set_to_none=True)
    probe = Probe(model, AGENTS, ROLES, method="auto", check_every=check_every)
    _, ids = mixed()
    model.zero_grad(set_to_none=True)
    with probe.step(0) as s:
        with s.rows(ids.max(1).values):
            loss, ids = mixed()
        s.backward_tokens(loss, ids)
    probe.close()
    assert s.result.method == "split-fallback:mixed-rows" and not probe._method.failed_check
    assert rel_err(s.result.gram, expected) < 1e-9


def test_a_forward_already_back_propagated_outside_the_probe_goes_to_split_saying_so():
    """A regulariser's autograd.grad through the forward before the probed backward (the trainer's coherence
    regulariser does this): hooks attributes a forward's first backward only, so the call goes to split, and
    the warning names that cause (not reentrant checkpointing)."""
    model = EmbedLM(dtype=torch.float64)
    call = embed_case(model)()
    expected = brute([call], list(model.parameters()))
    model.zero_grad(set_to_none=True)
    probe = Probe(model, AGENTS, ROLES, method="auto")
    with probe.step(0) as s:
        loss, ids = call()
        torch.autograd.grad(loss.sum(), list(model.parameters()), retain_graph=True)
        with pytest.warns(RuntimeWarning, match="already back-propagated by a backward outside the probe"):
            s.backward_tokens(loss, ids)
    probe.close()
    assert s.result.method == "split-fallback:unmatched-rows"
    assert rel_err(s.result.gram, expected) < 1e-9


@pytest.mark.parametrize("sketch", [None, 16])
def test_a_probed_step_leaves_no_graph_alive(sketch):
    """A call's graph edge holds its autograd node and the node holds the call (its on_grad or tensor hook): a
    cycle Python's collector cannot see. Left in place it kept every step's graph alive (+60 MB a step on a
    small LoRA LM). Covers the fused Linear path, an embedding (tensor hook) and a call the loss never reaches."""
    import gc
    import weakref

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    probe = Probe(model, AGENTS[:2], {a: ROLES[a] for a in AGENTS[:2]}, method="hooks", sketch=sketch)
    nodes = []
    for step in range(3):
        with probe.step(step) as s:
            h = model[0](torch.randint(0, 10, (4, 5)))
            hidden = model[1](h)
            unused = model[3](h)  # a call no loss reaches
            nodes.append(weakref.ref(hidden.grad_fn))
            y = model[3](model[2](hidden)).squeeze(-1)
            s.backward_tokens(y, torch.tensor([0, 1, 0, 1])[:, None].expand(4, 5))
        del h, hidden, unused, y
    gc.collect()
    assert all(node() is None for node in nodes)
    mine = {id(m) for m in model.modules()}
    assert not [o for o in gc.get_objects() if isinstance(o, Piece) and id(o.layer.module) in mine]
    probe.close()


def test_the_end_of_a_step_reads_no_value_per_parameter():
    """Each value read to the host is a device sync on a GPU: the magnitudes of the add-up check and the squared
    norms of the gradients (before and during the step) are read once per step, not once per parameter (they
    were: two reads a parameter). Counted on the CPU as the profiler's scalar reads; with ``.grad`` already set
    (accumulation), K = 4 agents, rows of several agents."""
    from torch.profiler import ProfilerActivity, profile

    def reads(depth: int) -> int:
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(6, 6) for _ in range(depth)])
        probe = Probe(model, AGENTS, ROLES, method="hooks")
        x, ids = torch.randn(8, 3, 6), torch.arange(8)[:, None].expand(8, 3) % 4
        try:
            for step in range(3):  # the first checks itself against split; .grad accumulates
                with profile(activities=[ProfilerActivity.CPU]) if step == 2 else nullcontext() as prof:
                    with probe.step(step) as s:
                        s.backward_tokens(model(x).square().mean(-1), ids)
        finally:
            probe.close()
        assert s.result.method == "hooks"
        return sum(e.count for e in prof.key_averages() if e.key in ("aten::item", "aten::_local_scalar_dense"))

    assert reads(16) == reads(2)


def test_a_micro_batch_of_no_agent_on_a_dense_weight():
    """A micro-batch whose rows are all prompt or padding (agent -1) after one that made a full-width weight dense:
    ``torch.stack`` of no per-agent products raised a RuntimeError out of the backward."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
    x, ids = torch.randn(16, 40, 64), (torch.arange(16) % 4)[:, None].expand(16, 40)
    terms = {a: model(x).squeeze(-1)[ids == k].sum() for k, a in enumerate(AGENTS)}
    expected = brute_force_gram(terms, list(model.parameters()))
    model.zero_grad(set_to_none=True)
    probe = Probe(model, AGENTS, ROLES, method="hooks")
    with probe.step(0) as s:
        s.backward_tokens(model(x).squeeze(-1), ids)
        s.backward_tokens(model(torch.randn(2, 1, 64)).squeeze(-1) * 0, torch.full((2, 1), -1))
    probe.close()
    assert s.result.method == "hooks+check" and rel_err(s.result.gram, expected) < 1e-5


def test_a_step_handle_after_its_block_and_a_second_probe():
    """A call on a step's handle after its ``with`` block added gradient that no Gram held, silently; a second
    probe on the same layers took the first one's calls, whose next backward then blamed retain_graph. Now: a
    ProbeError ('not open'); the newer probe takes the layers over and the older one is closed, saying so."""
    torch.manual_seed(0)
    model = make_mlp()
    x, rows = torch.randn(4, 5), [0, 1, 2, 3]
    probe = Probe(model, AGENTS, ROLES, method="hooks")
    with probe.step(0) as s:
        s.backward_rows(model(x).sum(1), rows)
    with pytest.raises(ProbeError, match="step 0 is not open"):
        s.backward_rows(model(x).sum(1), rows)
    with pytest.warns(RuntimeWarning, match="the older probe is closed"):
        newer = Probe(model, AGENTS, ROLES, method="hooks")
    with pytest.raises(ProbeError, match="a newer Probe hooks the same layers"):
        with probe.step(1):
            pass
    model.zero_grad(set_to_none=True)
    with newer.step(1) as s:
        s.backward_rows(model(x).sum(1), rows)
    newer.close()
    terms = {a: model(x).sum(1)[k] for k, a in enumerate(AGENTS)}
    assert rel_err(s.result.gram, brute_force_gram(terms, list(model.parameters()))) < 1e-5
    Probe(model, AGENTS, ROLES, method="hooks").close()  # the closed one no longer holds the layers: no warning


def test_a_probe_that_cannot_be_built_leaves_the_open_one_alone():
    """Probe(..., optimizer=SGD) raises; it closed the older probe on the same layers first (its next step
    raised) and left its own forwards installed. Now the optimizer is refused before any layer is taken."""
    import warnings

    torch.manual_seed(0)
    model = make_mlp()
    x, rows = torch.randn(4, 5), [0, 1, 2, 3]
    probe = Probe(model, AGENTS, ROLES, method="hooks")
    installed = {name: vars(m).get("forward") for name, m in model.named_modules()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "older probe is closed"
        for optimizer in (torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.AdamW(nn.Linear(2, 2).parameters())):
            with pytest.raises(ProbeError, match="unavailable for SGD|updates none of the probed parameters"):
                Probe(model, AGENTS, ROLES, method="hooks", optimizer=optimizer)
        with pytest.raises(ProbeError, match="may not be named 'weight_decay'"):  # a role named like a component
            Probe(model, AGENTS, {a: "weight_decay" for a in AGENTS}, method="hooks",
                  optimizer=torch.optim.AdamW(model.parameters()))
        spread = make_mlp()  # parameters on two devices: hooks takes them, update attribution cannot
        older = Probe(spread, AGENTS, ROLES, method="hooks")
        list(spread.children())[-1].to("meta")
        before = {name: vars(m).get("forward") for name, m in spread.named_modules()}
        with pytest.raises(ProbeError, match="all probed parameters on one device"):
            Probe(spread, AGENTS, ROLES, method="hooks", optimizer=torch.optim.AdamW(spread.parameters()))
        assert {name: vars(m).get("forward") for name, m in spread.named_modules()} == before
        older.close()
    assert {name: vars(m).get("forward") for name, m in model.named_modules()} == installed
    with probe.step(0) as s:
        s.backward_rows(model(x).sum(1), rows)
    terms = {a: model(x).sum(1)[k] for k, a in enumerate(AGENTS)}
    assert rel_err(s.result.gram, brute_force_gram(terms, list(model.parameters()))) < 1e-5


def test_agent_ids_must_be_integers_and_check_every_not_a_bool():
    model = make_mlp()
    with pytest.raises(ProbeError, match="check_every must be None or an integer"):
        Probe(model, AGENTS, ROLES, check_every=True)
    probe = Probe(model, AGENTS, ROLES, method="hooks")
    with pytest.raises(ProbeError, match="agent_ids must be integers, got torch.float32"):
        with probe.step(0) as s:
            s.backward_tokens(model(torch.randn(4, 2, 5)).sum(-1), torch.zeros(4, 2))
    probe.close()


def test_group_prefixes_must_be_a_list():
    """``groups={"head": "2."}`` was read as the prefixes '2' and '.': a silently wrong grouping."""
    with pytest.raises(ProbeError, match="prefixes of group 'head' must be a list of strings, got '2.'"):
        Probe(make_mlp(), AGENTS, ROLES, groups={"body": ["0."], "head": "2."})
    Probe(make_mlp(), AGENTS, ROLES, groups={"body": ["0."], "head": ["2."]}).close()
