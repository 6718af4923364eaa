"""gradscope.stats against brute force on explicit gradient vectors, plus constructed cases."""

import warnings

import numpy as np
import pytest

from gradscope import stats

RTOL = 1e-10
ATOL = 1e-12  # values are O(1); only shields entries that happen to be near 0

AGENTS = ["voter0", "voter1", "voter2", "aggregator"]
ROLES_OF = ["voter", "voter", "voter", "aggregator"]
# A mixed map: interleaved roles, one role of size 1, one of size 3, one of size 2.
MIXED_ROLES = ["a", "b", "a", "c", "b", "a"]

BATCH_SHAPES = [(), (7,), (2, 3)]


@pytest.fixture(autouse=True)
def _no_warnings():
    """Every test fails on any warning or floating-point error, degenerate or not."""
    with warnings.catch_warnings(), np.errstate(divide="raise", over="raise", invalid="raise"):
        warnings.simplefilter("error")
        yield


def close(actual, expected):
    np.testing.assert_allclose(actual, expected, rtol=RTOL, atol=ATOL)


def gram(g):
    return g @ np.swapaxes(g, -1, -2)


def random_vectors(rng, shape, K, D=40):
    """Per-agent gradients with a shared component, so cosines are not all near 0."""
    shared = rng.normal(size=shape + (1, D))
    return shared * rng.uniform(-1, 2, size=shape + (K, 1)) + rng.normal(size=shape + (K, D))


# ---------------------------------------------------------------------------------------------
# Brute force: everything computed from the vectors themselves, one step at a time.


def members(agent_roles):
    roles = list(dict.fromkeys(agent_roles))
    return roles, [[k for k, r in enumerate(agent_roles) if r == role] for role in roles]


def brute_step(g, tokens, agent_roles, B):
    """Every statistic of one step (g: K x D) by direct vector arithmetic."""
    roles, idx = members(agent_roles)
    K, R = len(g), len(roles)
    gr = np.array([g[ix].sum(axis=0) for ix in idx])
    total = g.sum(axis=0)
    an = np.array([np.linalg.norm(v) for v in g])
    rn = np.array([np.linalg.norm(v) for v in gr])
    cos = np.array([[np.dot(g[k], g[l]) / (an[k] * an[l]) for l in range(K)] for k in range(K)])
    rcos = np.array([[np.dot(gr[i], gr[j]) / (rn[i] * rn[j]) for j in range(R)] for i in range(R)])
    ntok = np.array([tokens[ix].sum() for ix in idx])
    per_tok = rn / ntok
    af = np.array([np.linalg.norm(gr[r]) / an[ix].mean() if len(ix) >= 2 else np.nan
                   for r, ix in enumerate(idx)])
    sf, ns = [], []
    for ix in idx:
        if len(ix) < 2:
            sf.append(np.nan)
            ns.append(np.nan)
            continue
        diag = np.mean([np.dot(g[k], g[k]) for k in ix])
        off = np.mean([np.dot(g[k], g[l]) for k in ix for l in ix if k != l])
        sf.append(off / diag)
        ns.append(B * (diag - off) / off if off > 0 else np.inf)
    return {
        "role_gram": np.array([[np.dot(a, b) for b in gr] for a in gr]),
        "agent_norms": an,
        "role_norms": rn,
        "total_norm": np.linalg.norm(total),
        "cosine": cos,
        "role_cosine": rcos,
        "contribution_shares": np.array([np.dot(v, total) for v in gr]) / np.dot(total, total),
        "mass_shares": rn / rn.sum(),
        "token_shares": ntok / ntok.sum(),
        "per_token_shares": per_tok / per_tok.sum(),
        "amplification_factor": af,
        "coherence": af / np.array([len(ix) for ix in idx]),
        "signal_fraction": np.array(sf),
        "noise_scale": np.array(ns),
    }


def brute(g, tokens, agent_roles, B):
    """brute_step over every leading index of a stack, results stacked the same way."""
    shape = g.shape[:-2]
    steps = [brute_step(g[i], tokens[i], agent_roles, B) for i in np.ndindex(*shape)]
    return {name: np.array([s[name] for s in steps]).reshape(shape + np.shape(steps[0][name]))
            for name in steps[0]}


def computed(M, tokens, P, B):
    return {
        "role_gram": stats.role_gram(M, P),
        "agent_norms": stats.agent_norms(M),
        "role_norms": stats.role_norms(M, P),
        "total_norm": stats.total_norm(M),
        "cosine": stats.cosine(M),
        "role_cosine": stats.cosine(stats.role_gram(M, P)),
        "contribution_shares": stats.contribution_shares(M, P),
        "mass_shares": stats.mass_shares(M, P),
        "token_shares": stats.token_shares(tokens, P),
        "per_token_shares": stats.per_token_shares(M, tokens, P),
        "amplification_factor": stats.amplification_factor(M, P),
        "coherence": stats.coherence(M, P),
        "signal_fraction": stats.signal_fraction(M, P),
        "noise_scale": stats.noise_scale(M, P, B),
    }


@pytest.mark.parametrize("shape", BATCH_SHAPES)
@pytest.mark.parametrize("agent_roles", [ROLES_OF, MIXED_ROLES], ids=["voting", "mixed"])
def test_every_statistic_matches_brute_force(shape, agent_roles):
    rng = np.random.default_rng(len(shape) * 10 + len(agent_roles))
    K = len(agent_roles)
    g = random_vectors(rng, shape, K)
    tokens = rng.integers(1, 200, size=shape + (K,)).astype(float)
    P, _ = stats.role_indicator(agent_roles)
    B = 16.0
    got = computed(gram(g), tokens, P, B)
    want = brute(g, tokens, agent_roles, B)
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == np.float64, name
        assert got[name].shape == want[name].shape, name
        np.testing.assert_allclose(got[name], want[name], rtol=RTOL, atol=ATOL, err_msg=name)


def test_batched_equals_per_step():
    rng = np.random.default_rng(1)
    M = gram(random_vectors(rng, (5,), 4))
    tokens = rng.integers(1, 50, size=(5, 4)).astype(float)
    P, _ = stats.role_indicator(ROLES_OF)
    stacked = computed(M, tokens, P, 8.0)
    for i in range(5):
        single = computed(M[i], tokens[i], P, 8.0)
        for name in single:
            np.testing.assert_array_equal(stacked[name][i], single[name], err_msg=name)


def test_noise_scale_per_step_batch_size():
    rng = np.random.default_rng(2)
    M = gram(random_vectors(rng, (3,), 4))
    P, _ = stats.role_indicator(ROLES_OF)
    B = np.array([4.0, 8.0, 64.0])
    got = stats.noise_scale(M, P, B)
    for i in range(3):
        close(got[i], stats.noise_scale(M[i], P, B[i]))


# ---------------------------------------------------------------------------------------------
# Role indicator and validation


def test_role_indicator_first_appearance_and_given_order():
    P, roles = stats.role_indicator(MIXED_ROLES)
    assert roles == ["a", "b", "c"]
    np.testing.assert_array_equal(
        P, [[1, 0, 0], [0, 1, 0], [1, 0, 0], [0, 0, 1], [0, 1, 0], [1, 0, 0]]
    )
    assert P.dtype == np.float64
    P2, roles2 = stats.role_indicator(MIXED_ROLES, roles=["c", "a", "b", "unused"])
    assert roles2 == ["c", "a", "b", "unused"]
    np.testing.assert_array_equal(P2, np.c_[P[:, [2, 0, 1]], np.zeros(6)])


def test_role_indicator_rejects_unknown_and_duplicate_roles():
    with pytest.raises(ValueError, match="'c'"):
        stats.role_indicator(["a", "c"], roles=["a", "b"])
    with pytest.raises(ValueError, match="duplicate"):
        stats.role_indicator(["a"], roles=["a", "a"])


def test_role_with_no_agents_is_defined():
    rng = np.random.default_rng(3)
    M = gram(random_vectors(rng, (), 4))
    P, _ = stats.role_indicator(ROLES_OF, roles=["voter", "aggregator", "judge"])
    assert stats.role_norms(M, P)[2] == 0.0
    assert stats.contribution_shares(M, P)[2] == 0.0
    assert stats.mass_shares(M, P)[2] == 0.0
    assert stats.per_token_shares(M, np.ones(4), P)[2] == 0.0
    assert np.isnan(stats.amplification_factor(M, P)[2])
    assert np.isnan(stats.noise_scale(M, P, 4.0)[2])


@pytest.mark.parametrize("bad", [np.zeros(3), np.zeros((3, 4)), np.zeros((2, 3, 4))])
def test_non_square_M_rejected(bad):
    with pytest.raises(ValueError, match="square"):
        stats.agent_norms(bad)
    with pytest.raises(ValueError, match="square"):
        stats.role_gram(bad, np.eye(3))
    with pytest.raises(ValueError, match="square"):
        stats.finite_mask(bad)


def test_P_mismatch_and_non_indicator_rejected():
    M = np.eye(4)
    P, _ = stats.role_indicator(["a", "a", "b"])
    for f in (stats.role_gram, stats.role_norms, stats.contribution_shares, stats.mass_shares,
              stats.amplification_factor, stats.coherence, stats.signal_fraction):
        with pytest.raises(ValueError, match="K = 4"):
            f(M, P)
    with pytest.raises(ValueError, match="K = 4"):
        stats.noise_scale(M, P, 1.0)
    with pytest.raises(ValueError, match="one-hot"):
        stats.role_gram(M, np.full((4, 2), 0.5))
    with pytest.raises(ValueError, match="one-hot"):
        stats.role_gram(M, np.zeros((4, 2)))


def test_tokens_and_batch_size_validated():
    M = np.eye(4)
    P, _ = stats.role_indicator(ROLES_OF)
    with pytest.raises(ValueError, match="tokens"):
        stats.token_shares(np.ones(3), P)
    with pytest.raises(ValueError, match="tokens"):
        stats.per_token_shares(M, np.ones(5), P)
    with pytest.raises(ValueError, match=">= 0"):
        stats.token_shares([1.0, -1.0, 1.0, 1.0], P)
    with pytest.raises(ValueError, match="batch_size"):
        stats.noise_scale(M, P, 0.0)


# ---------------------------------------------------------------------------------------------
# Constructed cases


@pytest.mark.parametrize("n", [2, 3, 5])
def test_identical_gradients_amplify_by_n(n):
    rng = np.random.default_rng(n)
    v = rng.normal(size=30)
    g = np.array([v] * n + [rng.normal(size=30)])
    P, _ = stats.role_indicator(["voter"] * n + ["aggregator"])
    close(stats.amplification_factor(gram(g), P)[0], n)
    close(stats.coherence(gram(g), P)[0], 1.0)
    # Same direction, different magnitudes: the norms add, so AF is still n.
    g_scaled = g * np.r_[np.arange(1, n + 1), 1.0][:, None]
    close(stats.amplification_factor(gram(g_scaled), P)[0], n)


@pytest.mark.parametrize("n", [2, 3, 5])
def test_orthogonal_equal_norm_gradients_amplify_by_sqrt_n(n):
    rng = np.random.default_rng(n)
    q, _ = np.linalg.qr(rng.normal(size=(20, n)))
    g = 2.5 * q.T
    P, _ = stats.role_indicator(["voter"] * n)
    close(stats.amplification_factor(gram(g), P)[0], np.sqrt(n))
    close(stats.coherence(gram(g), P)[0], 1 / np.sqrt(n))


def test_contribution_shares_sum_to_one():
    rng = np.random.default_rng(4)
    M = gram(random_vectors(rng, (50,), 6))
    P, _ = stats.role_indicator(MIXED_ROLES)
    close(stats.contribution_shares(M, P).sum(axis=-1), np.ones(50))
    close(stats.mass_shares(M, P).sum(axis=-1), np.ones(50))
    close(stats.per_token_shares(M, np.ones(6), P).sum(axis=-1), np.ones(50))


def test_role_pulling_against_the_step_has_negative_share():
    rng = np.random.default_rng(5)
    big = rng.normal(size=25)
    g = np.array([big, 0.5 * big + 0.1 * rng.normal(size=25), -0.4 * big])
    P, _ = stats.role_indicator(["voter", "voter", "aggregator"])
    s = stats.contribution_shares(gram(g), P)
    total = g.sum(axis=0)
    assert np.dot(g[2], total) < 0
    assert s[1] < 0 < s[0]
    assert s[0] > 1  # the other role must over-supply what the anti-aligned one removes
    close(s.sum(), 1.0)
    close(s[1], np.dot(g[2], total) / np.dot(total, total))
    assert (stats.mass_shares(gram(g), P) > 0).all()  # mass shares are unsigned


def test_ip_block_diagonal_shares_are_squared_norm_fractions():
    # Under IP roles touch disjoint parameters: zero-pad each role's vectors into its own block.
    rng = np.random.default_rng(6)
    voters = rng.normal(size=(3, 15))
    agg = 3.0 * rng.normal(size=(1, 10))
    g = np.block([[voters, np.zeros((3, 10))], [np.zeros((1, 15)), agg]])
    M = gram(g)
    P, _ = stats.role_indicator(ROLES_OF)
    MR = stats.role_gram(M, P)
    assert MR[0, 1] == 0.0 and MR[1, 0] == 0.0
    sq = np.array([np.sum(voters.sum(axis=0) ** 2), np.sum(agg**2)])
    close(stats.contribution_shares(M, P), sq / sq.sum())
    close(stats.cosine(MR)[0, 1], 0.0)


def test_token_share_and_per_token_share_tell_tokens_from_magnitude():
    P, _ = stats.role_indicator(["A", "B"])
    # Case 1: A writes 3x the tokens at the same per-token magnitude, so its norm is 3x.
    M1 = np.diag([3.0**2, 1.0])
    tok1 = np.array([300.0, 100.0])
    # Case 2: equal tokens, A's per-token gradient 3x bigger: same norms as case 1.
    tok2 = np.array([100.0, 100.0])
    close(stats.mass_shares(M1, P), [0.75, 0.25])
    close(stats.token_shares(tok1, P), [0.75, 0.25])
    close(stats.per_token_shares(M1, tok1, P), [0.5, 0.5])
    close(stats.token_shares(tok2, P), [0.5, 0.5])
    close(stats.per_token_shares(M1, tok2, P), [0.75, 0.25])


def test_noise_scale_recovers_known_value_on_exchangeable_agents():
    """g_k = mu + noise_k / sqrt(B), noise_k ~ N(0, Sigma): E M_kl = |mu|^2 (k != l) and
    E M_kk = |mu|^2 + tr(Sigma)/B, so B_noise = tr(Sigma)/|mu|^2 and the expected same-role cosine
    is the signal fraction 1 / (1 + B_noise / B)."""
    rng = np.random.default_rng(7)
    D, n, B, draws = 500, 3, 16.0, 600
    mu = rng.normal(size=D)
    mu *= 1.0 / np.linalg.norm(mu)  # |mu|^2 = 1
    sigma2 = rng.uniform(0.5, 1.5, size=D)
    sigma2 *= 48.0 / sigma2.sum()  # tr(Sigma) = 48 -> B_noise = 48 = 3 B
    b_noise = 48.0
    noise = rng.normal(size=(draws, n, D)) * np.sqrt(sigma2)
    M = gram(mu + noise / np.sqrt(B))
    P, _ = stats.role_indicator(["voter"] * n)
    # Average M, not the ratio: the ratio of one step's entries is a noisy, biased estimate.
    M_mean = M.mean(axis=0)
    ns = stats.noise_scale(M_mean, P, B)[0]
    sf = stats.signal_fraction(M_mean, P)[0]
    # Seeds 0-7 land within 1.5% of the truth (off-diagonal mean 1 +- ~0.005); a wrong formula
    # such as B*diag/off (= 64) or diag/off (= 4) is far outside 5%.
    assert ns == pytest.approx(b_noise, rel=0.05)
    assert sf == pytest.approx(1 / (1 + b_noise / B), rel=0.05)
    cos = stats.cosine(M)[:, ~np.eye(n, dtype=bool)].mean()
    assert cos == pytest.approx(1 / (1 + b_noise / B), rel=0.05)
    # Single steps are noisy estimates that scatter around it.
    per_step = stats.noise_scale(M, P, B)[:, 0]
    assert np.median(per_step) == pytest.approx(b_noise, rel=0.10)


# ---------------------------------------------------------------------------------------------
# Degenerate cases: exactly the documented values, with no warnings (see the autouse fixture).


def test_cosine_with_zero_vectors():
    g = np.array([[1.0, 0.0], [0.0, 0.0], [-2.0, 0.0]])
    c = stats.cosine(gram(g))
    np.testing.assert_array_equal(c, [[1, 0, -1], [0, 0, 0], [-1, 0, 1]])
    np.testing.assert_array_equal(stats.cosine(np.zeros((3, 3))), np.zeros((3, 3)))


def test_cosine_clipped_to_unit_interval():
    # Not quite a Gram matrix (rounding): |M_01| slightly exceeds sqrt(M_00 M_11).
    M = np.array([[1.0, 1.0 + 1e-12], [1.0 + 1e-12, 1.0]])
    c = stats.cosine(M)
    assert c.max() == 1.0
    assert stats.cosine(-M + 2 * np.diag(np.diag(M)))[0, 1] == -1.0


def test_negative_rounding_on_diagonal_gives_zero_norm():
    M = np.array([[-1e-18, 0.0], [0.0, 4.0]])
    np.testing.assert_array_equal(stats.agent_norms(M), [0.0, 2.0])
    np.testing.assert_array_equal(stats.cosine(M), [[0.0, 0.0], [0.0, 1.0]])
    assert stats.total_norm(np.array([[-1e-18]])) == 0.0


def test_zero_total_gradient_gives_zero_contribution_shares():
    P, _ = stats.role_indicator(["a", "b"])
    v = np.array([0.3, -1.7, 2.9])
    exact = gram(np.array([v, -v]))  # roles cancel exactly
    np.testing.assert_array_equal(stats.contribution_shares(exact, P), [0.0, 0.0])
    # Cancellation up to rounding: total is ~1e-16 of the role norms, below the 1e-12 threshold.
    M = np.array([[1.0, -1.0 + 1e-16], [-1.0 + 1e-16, 1.0]])
    assert 0 < M.sum() <= 1e-12 * 2.0
    np.testing.assert_array_equal(stats.contribution_shares(M, P), [0.0, 0.0])
    # Negative total (not a valid Gram, but must still not divide).
    np.testing.assert_array_equal(stats.contribution_shares(M - 1e-3, P), [0.0, 0.0])
    np.testing.assert_array_equal(stats.contribution_shares(np.zeros((2, 2)), P), [0.0, 0.0])
    # Just above the threshold the shares are defined.
    assert stats.contribution_shares(M + 1e-6, P).sum() == pytest.approx(1.0)


def test_all_role_norms_zero_gives_zero_mass_shares():
    P, _ = stats.role_indicator(ROLES_OF)
    np.testing.assert_array_equal(stats.mass_shares(np.zeros((4, 4)), P), [0.0, 0.0])
    # Voters cancel within their role, the aggregator is zero: role norms are 0, agent norms not.
    v = np.array([1.0, 2.0])
    g = np.array([v, -v, 0 * v, 0 * v])
    np.testing.assert_array_equal(stats.mass_shares(gram(g), P), [0.0, 0.0])


def test_token_share_degenerate_values():
    P, _ = stats.role_indicator(ROLES_OF)
    np.testing.assert_array_equal(stats.token_shares(np.zeros(4), P), [0.0, 0.0])
    M = np.diag([1.0, 1.0, 1.0, 4.0])
    # Role with 0 tokens: per-token share 0, the rest renormalised among the others.
    np.testing.assert_array_equal(stats.per_token_shares(M, [0, 0, 0, 10], P), [0.0, 1.0])
    np.testing.assert_array_equal(stats.per_token_shares(M, np.zeros(4), P), [0.0, 0.0])
    # Tokens present but every role's norm 0.
    np.testing.assert_array_equal(stats.per_token_shares(np.zeros((4, 4)), np.ones(4), P), [0, 0])


def test_single_agent_roles_have_nan_peer_statistics():
    rng = np.random.default_rng(8)
    M = gram(random_vectors(rng, (), 4))
    P, _ = stats.role_indicator(ROLES_OF)
    for f in (stats.amplification_factor, stats.coherence, stats.signal_fraction):
        out = f(M, P)
        assert np.isfinite(out[0]) and np.isnan(out[1]), f.__name__
    ns = stats.noise_scale(M, P, 8.0)
    assert np.isnan(ns[1])


def test_zero_norm_role_with_peers():
    P, _ = stats.role_indicator(ROLES_OF)
    M = np.zeros((4, 4))
    M[3, 3] = 1.0
    np.testing.assert_array_equal(stats.amplification_factor(M, P), [0.0, np.nan])
    np.testing.assert_array_equal(stats.coherence(M, P), [0.0, np.nan])
    np.testing.assert_array_equal(stats.signal_fraction(M, P), [0.0, np.nan])
    np.testing.assert_array_equal(stats.noise_scale(M, P, 8.0), [np.nan, np.nan])


def test_noise_scale_infinite_without_shared_signal():
    P, _ = stats.role_indicator(["v", "v", "v"])
    orthogonal = np.eye(3)  # off = 0, diag = 1
    assert stats.noise_scale(orthogonal, P, 8.0)[0] == np.inf
    assert stats.signal_fraction(orthogonal, P)[0] == 0.0
    v = np.array([1.0, 0.5])
    anti = gram(np.array([v, -v, 0.1 * v]))  # off < 0
    assert stats.noise_scale(anti, P, 8.0)[0] == np.inf
    assert stats.signal_fraction(anti, P)[0] < 0


def test_non_finite_step_is_nan_everywhere_only_for_that_step():
    rng = np.random.default_rng(9)
    M = gram(random_vectors(rng, (4,), 4))
    tokens = rng.integers(1, 50, size=(4, 4)).astype(float)
    P, _ = stats.role_indicator(ROLES_OF)
    clean = computed(M, tokens, P, 8.0)
    M_bad = M.copy()
    M_bad[1, 0, 2] = np.nan
    M_bad[2, 3, 3] = np.inf
    M_bad[3, 1, 0] = -np.inf
    np.testing.assert_array_equal(stats.finite_mask(M_bad), [True, False, False, False])
    assert stats.finite_mask(M[0]).shape == ()
    tokens_bad = tokens.copy()
    tokens_bad[0, 2] = np.inf
    got = computed(M_bad, tokens_bad, P, 8.0)
    # Step 0 has bad tokens, steps 1-3 a bad M: each statistic is NaN where its inputs are bad.
    for name in got:
        uses_M, uses_tokens = name != "token_shares", "token" in name
        bad = np.array([uses_tokens, uses_M, uses_M, uses_M])
        assert np.isnan(got[name][bad]).all(), name
        np.testing.assert_array_equal(got[name][~bad], clean[name][~bad], err_msg=name)
    # A non-finite batch size poisons only its step.
    ns = stats.noise_scale(M, P, np.array([8.0, np.nan, 8.0, 8.0]))
    assert np.isnan(ns[1]).all()
    np.testing.assert_array_equal(ns[[0, 2, 3]], clean["noise_scale"][[0, 2, 3]])


# ---------------------------------------------------------------------------------------------
# derive()


def expected_columns(agents, roles):
    cols = ["total_norm"] + [f"norm/{a}" for a in agents]
    for prefix in ("role_norm", "share", "mass_share", "token_share", "per_token_share", "af",
                   "coherence", "signal_fraction"):
        cols += [f"{prefix}/{r}" for r in roles]
    for prefix, names in (("cos", agents), ("role_cos", roles)):
        cols += [f"{prefix}/{a}|{b}" for i, a in enumerate(names) for b in names[i + 1:]]
    return cols


@pytest.mark.parametrize("shape", BATCH_SHAPES)
def test_derive_columns_shapes_and_values(shape):
    rng = np.random.default_rng(10)
    agents = ["w0", "orch", "w1", "synth", "w2", "critic"]
    g = random_vectors(rng, shape, 6)
    tokens = rng.integers(1, 80, size=shape + (6,)).astype(float)
    out = stats.derive(gram(g), tokens, agents, MIXED_ROLES)
    assert list(out) == expected_columns(agents, ["a", "b", "c"])
    for name, col in out.items():
        assert isinstance(col, np.ndarray) and col.shape == shape and col.dtype == np.float64, name
        assert col.flags.writeable, name
    want = brute(g, tokens, MIXED_ROLES, 1.0)
    close(out["total_norm"], want["total_norm"])
    close(out["norm/w2"], want["agent_norms"][..., 4])
    close(out["share/b"], want["contribution_shares"][..., 1])
    close(out["per_token_share/c"], want["per_token_shares"][..., 2])
    close(out["af/a"], want["amplification_factor"][..., 0])
    assert np.isnan(out["af/c"]).all()
    close(out["cos/orch|critic"], want["cosine"][..., 1, 5])
    close(out["role_cos/a|c"], want["role_cosine"][..., 0, 2])


def test_derive_broadcasts_shared_tokens_and_poisons_bad_steps():
    rng = np.random.default_rng(11)
    M = gram(random_vectors(rng, (3,), 4))
    M[1, 0, 0] = np.nan
    out = stats.derive(M, [10.0, 10.0, 10.0, 5.0], AGENTS, ROLES_OF)
    peerless = {"af/aggregator", "coherence/aggregator", "signal_fraction/aggregator"}
    for name, col in out.items():
        assert col.shape == (3,), name
        assert np.isnan(col[1]), name
        assert np.isnan(col[[0, 2]]).all() == (name in peerless), name
    # Non-finite tokens poison the whole row in derive, norms included.
    tokens = np.ones((3, 4))
    tokens[2, 1] = np.nan
    out = stats.derive(M, tokens, AGENTS, ROLES_OF)
    assert all(np.isnan(col[2]) for col in out.values())


def test_derive_rejects_inconsistent_inputs():
    M = np.eye(4)
    with pytest.raises(ValueError, match="K = 4"):
        stats.derive(M, np.ones(4), AGENTS[:3], ROLES_OF[:3])
    with pytest.raises(ValueError, match="unique"):
        stats.derive(M, np.ones(4), ["a", "a", "b", "c"], ROLES_OF)
    with pytest.raises(ValueError, match="tokens"):
        stats.derive(M, np.ones((2, 4)), AGENTS, ROLES_OF)


def test_coherence_of_equal_norm_agents_follows_mean_pairwise_cosine():
    """docs/metrics.md: for equal norms, coherence^2 = 1/n + (1 - 1/n) * mean pairwise cosine."""
    rng = np.random.default_rng(12)
    n = 4
    g = random_vectors(rng, (6,), n)
    g /= np.linalg.norm(g, axis=-1, keepdims=True)
    M = gram(g)
    P, _ = stats.role_indicator(["v"] * n)
    mean_cos = stats.cosine(M)[:, ~np.eye(n, dtype=bool)].mean(axis=-1)
    close(stats.coherence(M, P)[:, 0] ** 2, 1 / n + (1 - 1 / n) * mean_cos)
    # With equal norms the mean pairwise cosine is exactly the signal fraction.
    close(stats.signal_fraction(M, P)[:, 0], mean_cos)
