"""Update attribution under Adam/AdamW against brute force: per-role gradients from separate autograd
calls, per-role first moments kept by hand, the optimizer's own v, and its actual parameter change."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn as nn

from gradscope.errors import ProbeError
from gradscope.peft_support import adapter_parameters, use_adapter
from gradscope.probe import Probe, Sketch
from tests.gradscope.test_probe import AGENTS, ROLES, make_mlp
from tests.gradscope.tiny_lm import batch, tiny_lora_lm

UNITS = {"role": ["voter", "aggregator"], "agent": AGENTS}
OWNER = {"role": ROLES, "agent": {a: a for a in AGENTS}}


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).double() for t in tensors])


def per_agent_grads(terms: dict[str, torch.Tensor], params) -> torch.Tensor:
    """(K, P) float64: one autograd.grad per agent term."""
    rows = []
    for a in AGENTS:
        grads = torch.autograd.grad(terms[a], params, retain_graph=True, allow_unused=True)
        rows.append(flat(torch.zeros_like(p) if g is None else g for g, p in zip(grads, params)))
    return torch.stack(rows)


class BruteAdam:
    """Per-unit first moments of one Adam/AdamW param group, by hand, and the components of its steps."""

    def __init__(self, opt: torch.optim.Optimizer, params, unit: str) -> None:
        self.opt, self.params, self.unit = opt, list(params), unit
        self.units = UNITS[unit]
        n = sum(p.numel() for p in self.params)
        self.m = torch.zeros(len(self.units), n, dtype=torch.float64)
        self.m_l2 = torch.zeros(n, dtype=torch.float64)

    def unit_grads(self, G: torch.Tensor) -> torch.Tensor:
        return torch.stack([G[[k for k, a in enumerate(AGENTS) if OWNER[self.unit][a] == u]].sum(0)
                            for u in self.units])

    def step(self, G: torch.Tensor, scale: float, theta0: torch.Tensor) -> torch.Tensor:
        """Advance the moments by the step whose per-agent gradients were G (K, P), times ``scale``;
        return the (U + 2, P) components: units, unattributed, weight decay."""
        group = self.opt.param_groups[0]
        b1, b2 = group["betas"]
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        decoupled = isinstance(self.opt, torch.optim.AdamW)
        sign = -1.0 if group["maximize"] else 1.0
        state = [self.opt.state[p] for p in self.params]
        t = float(state[0]["step"])
        self.m = b1 * self.m + (1 - b1) * sign * scale * self.unit_grads(G)
        if not decoupled:
            self.m_l2 = b1 * self.m_l2 + (1 - b1) * wd * theta0
        v = flat(s["max_exp_avg_sq" if group["amsgrad"] else "exp_avg_sq"] for s in state)
        d = v.sqrt() / (1 - b2 ** t) ** 0.5 + eps
        step_size = lr / (1 - b1 ** t)
        m_total = flat(s["exp_avg"] for s in state)
        decay = -lr * wd * theta0 if decoupled else -step_size * self.m_l2 / d
        unattributed = m_total - self.m.sum(0) - (0 if decoupled else self.m_l2)
        return torch.cat([-step_size * self.m / d, (-step_size * unattributed / d)[None], decay[None]])


def mlp_terms(model: nn.Module, seed: int, n: int = 6) -> dict[str, torch.Tensor]:
    """Each agent regresses its own batch (in the model's dtype); terms normalised by the total count."""
    g = torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    return {a: ((model(torch.randn(n, 5, generator=g).to(dtype)) - torch.randn(n, 3, generator=g).to(dtype)) ** 2
                ).sum() / (n * len(AGENTS)) for a in AGENTS}


def rel(a, b) -> float:
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-300))


OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=3e-2, weight_decay=0.1),
    "adamw-amsgrad": lambda ps: torch.optim.AdamW(ps, lr=3e-2, weight_decay=0.1, amsgrad=True, betas=(0.8, 0.9)),
    "adam-l2-maximize": lambda ps: torch.optim.Adam(ps, lr=3e-2, weight_decay=0.1, maximize=True),
}


@pytest.mark.parametrize("unit", ["role", "agent"])
@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_components_add_up_to_the_actual_change_and_match_brute_force(kind, unit):
    """Five optimizer steps of a float64 MLP (all agents share it): clipped ones, an unclipped one, and
    between them a probed step whose gradient is NaN, which the loop skips (the moments must not advance)."""
    model = make_mlp().double()
    params = list(model.parameters())
    opt = OPTIMIZERS[kind](params)
    probe = Probe(model, AGENTS, ROLES, method="split", optimizer=opt, update_unit=unit)
    brute = BruteAdam(opt, params, unit)
    clip = [0.05, 10.0, 0.05, None, 0.08, 0.05]  # max grad norm per step; None: the skipped NaN step
    for t, max_norm in enumerate(clip):
        opt.zero_grad(set_to_none=True)
        terms = mlp_terms(model, seed=t)
        if max_norm is None:
            terms["voter1"] = terms["voter1"] * float("nan")
        G = per_agent_grads(terms, params)
        with probe.step(t) as s:
            s.backward(terms)
        if not s.result.finite:  # what a training loop does: skip the step, drop the gradient
            assert max_norm is None
            opt.zero_grad(set_to_none=True)
            assert probe.last_update is None
            continue
        norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        scale = min(1.0, max_norm / (norm + 1e-6))
        theta0 = flat(params)
        opt.step()
        actual = flat(params) - theta0
        D = brute.step(G, scale, theta0)
        U = len(UNITS[unit])
        # the split itself: units + weight decay = the optimizer's actual change, to 1e-6 relative
        assert float((D[:U].sum(0) + D[-1] - actual).norm()) <= 1e-6 * float(actual.norm())
        assert float(D[U].norm()) <= 1e-9 * float(actual.norm())  # nothing unattributed
        u = probe.last_update
        assert u.step == t and u.exact and u.components == (*UNITS[unit], "unattributed", "weight_decay")
        assert u.grad_scale == pytest.approx(scale, rel=1e-9)
        assert u.residual < 1e-12
        gram = (D @ D.T).numpy()
        assert rel(u.gram, gram) < 1e-9
        assert abs(u.gram.sum() - float(actual @ actual)) <= 1e-9 * float(actual @ actual)
        assert rel(u.interference, (D @ G.T).numpy()) < 1e-9  # I_al = <Δθ_a, g_l>, g_l before clipping
    probe.close()


def test_unprobed_steps_are_unattributed_and_decay():
    """An optimizer step without a probed step puts its whole gradient into 'unattributed'; that part of the
    moment then decays by β1 per step while the split still adds up."""
    model = make_mlp().double()
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0, betas=(0.5, 0.999))
    probe = Probe(model, AGENTS, ROLES, method="split", optimizer=opt)
    opt.zero_grad(set_to_none=True)
    sum(mlp_terms(model, seed=0).values()).backward()
    opt.step()
    first = probe.last_update
    assert first.step is None and np.isnan(first.interference).all() and np.isnan(first.grad_scale)
    assert first.gram[2, 2] == pytest.approx(first.gram.sum(), rel=1e-12)  # all of it unattributed
    m_unattr = flat(opt.state[p]["exp_avg"] for p in params)
    for t in range(1, 3):
        opt.zero_grad(set_to_none=True)
        with probe.step(t) as s:
            s.backward(mlp_terms(model, seed=t))
        opt.step()
        u = probe.last_update
        m_unattr = 0.5 * m_unattr
        group, state = opt.param_groups[0], [opt.state[p] for p in params]
        d = flat(s["exp_avg_sq"] for s in state).sqrt() / (1 - 0.999 ** (t + 1)) ** 0.5 + group["eps"]
        expected = group["lr"] / (1 - 0.5 ** (t + 1)) * m_unattr / d
        assert u.gram[2, 2] == pytest.approx(float(expected @ expected), rel=1e-9)
        assert u.residual < 1e-12
    probe.close()


def lm_rows(model, ids, mask, rows, adv):
    """(token_loss, agent_ids) of one forward over ``rows``: -adv·log p on each row's tokens after the first two."""
    logits = model(input_ids=ids[rows], attention_mask=mask[rows]).logits[:, :-1]
    lp = torch.log_softmax(logits, -1).gather(-1, ids[rows, 1:, None])[..., 0] * mask[rows, 1:]
    return -adv[rows] * lp


def test_isolated_policy_cross_role_entries_are_exactly_zero():
    """IP: voters on adapter 'voter', the aggregator on 'aggregator', one AdamW over both, hooks method.
    Cross-role update inner products and cross-role interference are exactly 0."""
    model = tiny_lora_lm(["voter", "aggregator"], dtype=torch.float64)
    named = [(n, p) for ps in adapter_parameters(model).values() for n, p in ps]
    params = [p for _, p in named]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    probe = Probe(model, AGENTS, ROLES, params=named, method="hooks", optimizer=opt)
    ids, mask = batch(8, 10, seed=3)
    adv = torch.linspace(-1, 1, 8, dtype=torch.float64)[:, None]
    row_agent = torch.tensor([0, 1, 2, 0, 1, 2, 3, 3])
    for t in range(3):
        opt.zero_grad(set_to_none=True)
        with probe.step(t) as s:
            for adapter, rows in (("voter", slice(0, 6)), ("aggregator", slice(6, 8))):
                with use_adapter(model, adapter):
                    loss = lm_rows(model, ids, mask, rows, adv) / 40
                agent_ids = row_agent[rows, None].expand_as(loss).clone()
                agent_ids[:, :2] = -1
                s.backward_tokens(loss * (agent_ids >= 0), agent_ids)
        assert s.result.method.startswith("hooks")
        opt.step()
        u = probe.last_update
        assert u.gram[0, 1] == 0.0 and u.gram[1, 0] == 0.0
        assert (u.interference[0, 3] == 0.0) and (u.interference[1, :3] == 0.0).all()
        assert u.gram[0, 0] > 0 and u.gram[1, 1] > 0 and u.residual < 1e-12
    probe.close()


def test_hooks_on_a_shared_lora_lm_match_brute_force():
    """SP on a float64 LoRA LM, hooks method (per-agent gradients from one backward), AdamW, clipping."""
    model = tiny_lora_lm(["policy"], dtype=torch.float64)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.05)
    probe = Probe(model, AGENTS, ROLES, params=named, method="hooks", optimizer=opt)
    brute = BruteAdam(opt, params, "role")
    ids, mask = batch(8, 10, seed=5)
    adv = torch.linspace(-1, 1, 8, dtype=torch.float64)[:, None]
    agent_ids = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])[:, None].expand(8, 9).clone()
    agent_ids[:, :2] = -1
    for t in range(3):
        opt.zero_grad(set_to_none=True)
        reference = lm_rows(model, ids, mask, slice(None), adv) * (agent_ids >= 0) / 56
        G = per_agent_grads({a: reference[agent_ids == k].sum() for k, a in enumerate(AGENTS)}, params)
        loss = lm_rows(model, ids, mask, slice(None), adv) * (agent_ids >= 0) / 56  # a forward the hooks see
        with probe.step(t) as s:
            s.backward_tokens(loss, agent_ids)
        assert s.result.method.startswith("hooks")  # attributed by rows, not by a split fallback
        norm = float(torch.nn.utils.clip_grad_norm_(params, 0.02))
        theta0 = flat(params)
        opt.step()
        D = brute.step(G, min(1.0, 0.02 / (norm + 1e-6)), theta0)
        u = probe.last_update
        assert rel(u.gram, (D @ D.T).numpy()) < 1e-8
        assert rel(u.interference, (D @ G.T).numpy()) < 1e-8
        assert float((D[:2].sum(0) + D[3] - (flat(params) - theta0)).norm()) <= 1e-6 * float(D.sum(0).norm())
    probe.close()


def test_float32_split_adds_up_to_rounding():
    model = make_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    probe = Probe(model, AGENTS, ROLES, optimizer=opt)
    for t in range(3):
        opt.zero_grad(set_to_none=True)
        with probe.step(t) as s:
            s.backward(mlp_terms(model, seed=t))
        opt.step()
        u = probe.last_update
        assert u.residual < 1e-5
        assert u.gram[2, 2] <= 1e-10 * u.gram.sum()  # unattributed: fp32 rounding of Adam's own moment
    probe.close()


def run_sampled(sketch: Sketch | None, steps: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """The last step's (gram, interference) of a fixed float64 MLP run, exact or sampled."""
    model = make_mlp().double()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2, weight_decay=0.1)
    probe = Probe(model, AGENTS, ROLES, method="split", sketch=sketch, optimizer=opt)
    for t in range(steps):
        opt.zero_grad(set_to_none=True)
        with probe.step(t) as s:
            s.backward(mlp_terms(model, seed=t))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        opt.step()
    u = probe.last_update
    probe.close()
    return u.gram, u.interference


def test_sampled_mode_keeping_every_coordinate_is_exact():
    gram, inter = run_sampled(None)
    g2, i2 = run_sampled(Sketch(1000, seed=3))  # k >= every group's size: q = 1
    assert rel(g2, gram) < 1e-12 and rel(i2, inter) < 1e-12


def test_sampled_mode_is_unbiased_over_seeds():
    """k = 40 of 147 coordinates (q ≈ 0.27): the mean over 250 hash seeds of every Gram and interference
    entry is within 4.5 standard errors of the exact value (the exact one is a fixed number: sampling
    only observes, it does not change the run)."""
    gram, inter = run_sampled(None)
    est = [run_sampled(Sketch(40, seed=s)) for s in range(250)]
    grams, inters = np.stack([g for g, _ in est]), np.stack([i for _, i in est])
    # 'unattributed' (component 2) is 0 up to rounding in every run: it is no estimate
    assert np.abs(grams[:, 2]).max() < 1e-12 * np.abs(gram).max() and np.abs(inters[:, 2]).max() < 1e-12
    keep = [0, 1, 3]
    for exact, values in ((gram[np.ix_(keep, keep)], grams[:, keep][:, :, keep]), (inter[keep], inters[:, keep])):
        mean, se = values.mean(0), values.std(0, ddof=1) / len(values) ** 0.5
        z = np.abs(mean - exact) / np.where(se > 0, se, 1.0)
        assert (z < 4.5).all(), z
        assert np.allclose(mean[se == 0], exact[se == 0])
        assert (values.std(0) > 0).any()  # it is an estimate, not the exact value


def test_a_param_group_added_after_attach_is_attributed():
    """Progressive unfreezing: add_param_group after attach. The new group's parameters move from then on,
    and their moves are split too (they were left out: ΣU fell short of ‖Δθ‖² by 48 %, unseen)."""
    model = make_mlp().double()
    opt = torch.optim.AdamW(model[0].parameters(), lr=3e-2, weight_decay=0.1)
    probe = Probe(model, AGENTS, ROLES, method="split", optimizer=opt)
    for t in range(3):
        if t == 1:
            opt.add_param_group({"params": list(model[2].parameters())})
        model.zero_grad(set_to_none=True)
        with probe.step(t) as s:
            s.backward(mlp_terms(model, t))
        theta0 = flat(model.parameters())
        opt.step()
        moved = flat(model.parameters()) - theta0
        u = probe.last_update
        assert u.gram.sum() == pytest.approx(float(moved @ moved), rel=1e-10) and u.residual < 1e-12
        assert (float(moved[theta0.numel() - 51:] @ moved[theta0.numel() - 51:]) > 0) == (t > 0)  # model[2] moved


def test_other_optimizers_and_misuse_are_clear_errors():
    model = make_mlp()
    probe = Probe(model, AGENTS, ROLES)
    with pytest.raises(ProbeError, match="unavailable for SGD"):
        probe.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    opt = torch.optim.AdamW(model.parameters())
    probe.attach(opt)
    with pytest.raises(ProbeError, match="already attached"):
        probe.attach(opt)
    with pytest.raises(ProbeError, match="split by role"):
        probe.attach(torch.optim.AdamW(model.parameters()), unit="agent")
    other = nn.Linear(2, 2)
    with pytest.raises(ProbeError, match="none of the probed parameters"):
        probe.attach(torch.optim.AdamW(other.parameters()))
    reduced = make_mlp()
    reduced_probe = Probe(reduced, AGENTS, ROLES, method="hooks", grad_reduced=True)
    with pytest.raises(ProbeError, match="unavailable with grad_reduced=True"):
        reduced_probe.attach(torch.optim.AdamW(reduced.parameters()))
    reduced_probe.close()
    with pytest.raises(ProbeError, match="unit must be one of"):
        Probe(make_mlp(), AGENTS, ROLES, optimizer=torch.optim.AdamW(model.parameters()), update_unit="layer")
    probe.close()
    opt.zero_grad()
    sum(mlp_terms(model, 0).values()).backward()
    before = copy.deepcopy(opt.state)
    opt.step()  # hooks removed by close(): nothing recorded, nothing raised
    assert probe.last_update is None and not before


def probe_with_state(unit: str = "role", sketch: Sketch | None = None, steps: int = 2):
    """A float64 MLP probe with an attached AdamW after ``steps`` probed steps: (probe, optimizer, model)."""
    model = make_mlp().double()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2, weight_decay=0.1)
    probe = Probe(model, AGENTS, ROLES, method="split", sketch=sketch, optimizer=opt, update_unit=unit)
    for t in range(steps):
        opt.zero_grad(set_to_none=True)
        with probe.step(t) as s:
            s.backward(mlp_terms(model, seed=t))
        opt.step()
    return probe, opt, model


def test_update_state_of_another_layout_or_shape_is_refused_before_anything_changes():
    """load_update_state checked only the number of optimizers: role moments loaded into an agent probe crashed
    inside the next opt.step() (θ already moved), exact moments into a sampled probe were attributed to the
    wrong coordinates silently, and garbage gave raw TypeErrors. Now a ProbeError, the probe's moments
    untouched; a state saved before the layout was recorded (parameter index → moments only) still loads."""
    saved, _, _ = probe_with_state("role")
    state = saved.update_state()
    saved.close()
    for unit, sketch, why in (("agent", None, "components"), ("role", Sketch(40, seed=1), "coordinate sample")):
        probe, _, _ = probe_with_state(unit, sketch)
        before = {i: m.clone() for i, m in probe._updates.trackers[0].moments.items()}
        with pytest.raises(ProbeError, match=f"update-attribution state of components.*this probe's.*{why}"):
            probe.load_update_state(state)
        assert all(torch.equal(m, before[i]) for i, m in probe._updates.trackers[0].moments.items())
        probe.close()
    probe, opt, model = probe_with_state("role")
    i = next(k for k in state[0] if k != "layout")
    for bad, match in ((None, "list of dicts.*got NoneType"), ({"a": 1}, "got dict"), ([None], "holding NoneType"),
                       ([{**state[0], 99: state[0][i]}], "parameter 99"),
                       ([{**state[0], i: state[0][i][:, :2]}], f"parameter {i}: expected a tensor of shape"),
                       ([state[0], state[0]], "of 2 optimizers for 1 attached")):
        with pytest.raises(ProbeError, match=match):
            probe.load_update_state(bad)
    probe.load_update_state([{k: v for k, v in state[0].items() if k != "layout"}])  # an older checkpoint's
    assert all(torch.equal(m, state[0][k]) for k, m in probe._updates.trackers[0].moments.items())
    opt.zero_grad(set_to_none=True)
    with probe.step(2) as s:
        s.backward(mlp_terms(model, seed=2))
    opt.step()
    assert probe.last_update.residual < 1e-12
    probe.close()


def test_a_non_finite_step_the_loop_did_not_skip_has_no_residual():
    """A NaN gradient stepped anyway: θ is NaN and the split undefined; the residual said 0.0 (a perfect split)."""
    probe, opt, model = probe_with_state()
    opt.zero_grad(set_to_none=True)
    with probe.step(2) as s:
        s.backward({a: t * float("nan") for a, t in mlp_terms(model, seed=2).items()})
    opt.step()
    assert np.isnan(probe.last_update.residual)
    probe.close()


def test_adam_s_own_error_for_sparse_gradients_comes_through():
    """Adam on a sparse gradient: torch's message, not a reshape error from inside the probe's step hook."""
    model = nn.Sequential(nn.Embedding(10, 3, sparse=True), nn.Linear(3, 1))
    opt = torch.optim.Adam(model.parameters())
    probe = Probe(model, AGENTS, ROLES, method="split", optimizer=opt)
    with probe.step(0) as s:
        out = model(torch.arange(8).reshape(4, 2)).squeeze(-1)  # (B, T)
        s.backward_tokens(out, torch.arange(4)[:, None].expand(4, 2))
    with pytest.raises(RuntimeError, match="Adam does not support sparse gradients"):
        opt.step()
    probe.close()


@pytest.mark.slow
def test_two_ranks_give_the_one_process_split(tmp_path):
    """torchrun, 2 ranks (gloo): every rank's update attribution equals one process on the whole batch,
    exact and sampled (the coordinate sample is summed over the ranks like the sketch)."""
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    from tests.gradscope.updates_dist_child import SKETCHES, run_updates

    root = Path(__file__).resolve().parents[2]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--nnodes=1", "--master_addr=127.0.0.1",
           f"--master_port={port}", str(Path(__file__).with_name("updates_dist_child.py")), str(tmp_path)]
    proc = subprocess.run(cmd, cwd=root, env={**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for name, sketch in SKETCHES.items():
        single = run_updates([list(range(8))], lambda n: n, sketch)
        for r in (0, 1):
            rank = np.load(tmp_path / f"rank{r}.npz")
            assert rel(rank[f"{name}/gram"], single["gram"]) < 1e-8
            assert rel(rank[f"{name}/interference"], single["interference"]) < 1e-8


def test_sample_store_takes_outer_products_like_whole_products():
    """Wide weights reach the stores as per-token factors (``add_outer``); at the sampled coordinates the
    sample store must hold exactly what the whole per-agent products would give, and the tee hands both."""
    from gradscope.probe.sketch import SketchStore
    from gradscope.probe.updates import SampleStore, TeeStore

    layer = nn.Linear(48, 40)
    params, names = [layer.weight], ["w"]
    g = torch.Generator().manual_seed(0)
    G, A = torch.randn(30, 40, generator=g), torch.randn(30, 48, generator=g)
    agents = torch.randint(0, 4, (30,), generator=g)
    outer, whole = (SampleStore(params, names, [0], 1, 4, Sketch(200, seed=1)) for _ in range(2))
    tee = TeeStore(SketchStore(params, names, [0], 1, 4, Sketch(16, seed=1)), outer)
    tee.zero()
    whole.zero()
    tee.add_outer(0, agents, G, A)
    present = agents.unique().tolist()
    whole.add(0, present, torch.stack([G[agents == k].T @ A[agents == k] for k in present]).flatten(1))
    assert 100 < len(outer.coords(0)) < 300  # ≈ k = 200 of 1920 coordinates
    torch.testing.assert_close(outer.buffer, whole.buffer, rtol=1e-5, atol=1e-5)
    assert tee.small(0) is False and isinstance(tee.local_copy(), TeeStore)


def test_sampled_hooks_on_wide_layers_add_up():
    """Sketch mode with the hooks method on full-width Linear layers (tensor-hashed, fed per-token factors)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 3)).double()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    probe = Probe(model, AGENTS, ROLES, method="hooks", sketch=Sketch(16, seed=2), optimizer=opt)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 5, generator=g, dtype=torch.float64), torch.randn(8, 3, generator=g, dtype=torch.float64)
    for t in range(2):
        opt.zero_grad(set_to_none=True)
        with probe.step(t) as s:
            loss = ((model(x) - y) ** 2).sum(1, keepdim=True) / 8
            s.backward_rows(loss[:, 0], torch.tensor([0, 1, 2, 3, 0, 1, 2, 3]))
        opt.step()
        u = probe.last_update
        assert not u.exact and np.isfinite(u.gram).all() and np.isfinite(u.interference).all()
        assert u.residual < 1e-10 and abs(u.gram[2, 2]) < 1e-12 * u.gram.sum()
    probe.close()
