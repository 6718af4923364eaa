"""The update-attribution statistics against vectors: a stack of steps with a NaN one and a zero one."""
from __future__ import annotations

import numpy as np
import pytest

from gradscope import stats

AGENT_ROLES = ["voter", "voter", "voter", "aggregator"]


def test_statistics_from_component_vectors():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(3, 6, 20))            # 3 steps x (4 agents + unattributed + weight decay) x 20 coords
    X[1] = 0.0                                 # a zero step
    G = rng.normal(size=(3, 4, 20))            # per-agent gradients
    U = np.einsum("nad,nbd->nab", X, X)
    I = np.einsum("nad,nkd->nak", X, G)
    U[2, 0, 1] = np.nan                        # a bad step
    Q, names = stats.update_indicator(AGENT_ROLES, ["voter", "aggregator"])
    P, _ = stats.role_indicator(AGENT_ROLES)
    assert names == ["voter", "aggregator", "unattributed", "weight_decay"]
    role_vecs = np.stack([X[0, :3].sum(0), X[0, 3], X[0, 4], X[0, 5]])
    total = role_vecs.sum(0)
    assert stats.role_norms(U, Q)[0] == pytest.approx(np.linalg.norm(role_vecs, axis=1))
    assert stats.contribution_shares(U, Q)[0] == pytest.approx(role_vecs @ total / (total @ total))
    assert stats.contribution_shares(U, Q)[1].tolist() == [0.0] * 4          # zero step: shares 0
    assert np.isnan(stats.contribution_shares(U, Q)[2]).all()               # NaN step: NaN
    inter = stats.interference(I, Q, P)
    g_roles = np.stack([G[0, :3].sum(0), G[0, 3]])
    assert inter[0] == pytest.approx(role_vecs @ g_roles.T)
    assert inter.shape == (3, 4, 2) and np.isfinite(inter[2]).all()         # I itself is fine at step 2
    I[2, 5, 0] = np.inf
    assert np.isnan(stats.interference(I, Q, P)[2]).all() and np.isfinite(stats.interference(I, Q, P)[0]).all()
    cols = stats.derive_updates(U, I, AGENT_ROLES, AGENT_ROLES)
    assert cols["update_share/weight_decay"][0] == pytest.approx(role_vecs[3] @ total / (total @ total))
    assert cols["interference/unattributed|aggregator"][0] == pytest.approx(role_vecs[2] @ g_roles[1])
    assert np.isnan(cols["total_update_norm"][2]) and cols["total_update_norm"][1] == 0.0


def test_norm_shares():
    assert stats.norm_shares([[3.0, 1.0], [0.0, 0.0], [np.nan, 1.0]]).tolist()[:2] == [[0.75, 0.25], [0.0, 0.0]]
    assert np.isnan(stats.norm_shares([np.nan, 1.0])).all()
    M = np.diag([4.0, 1.0, 0.0, 9.0])
    P, _ = stats.role_indicator(AGENT_ROLES)
    assert stats.norm_shares(stats.role_norms(M, P)) == pytest.approx(stats.mass_shares(M, P))
    with pytest.raises(ValueError, match="one-hot"):
        stats.interference(np.zeros((4, 4)), np.ones((4, 4)), P)
