"""Alerts: the rule language, the engine against a reference implementation, values against the
analyses, actions, and ``gradscope watch`` following a live writer process."""
from __future__ import annotations

import random
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from gradscope.analyses.series import RunSeries
from gradscope.alerts import DEFAULT_RULES, AlertEngine, Monitor, StepValues, load_rules, parse_rule
from gradscope.alerts.engine import min_history
from gradscope.alerts.watch import Follower
from gradscope.errors import ConfigError
from gradscope.runfile import RunMeta, RunWriter, open_run

GRADSCOPE = [sys.executable, "-m", "gradscope.cli"]
AGENTS = ["voter0", "voter1", "voter2", "aggregator"]
ROLES = ["voter", "voter", "voter", "aggregator"]


# ---------------------------------------------------------------- the language
@pytest.mark.parametrize("text, fields", [
    ("coherence[voter] > 0.75 for 10", dict(statistic="coherence", selector="voter", op=">", threshold=0.75,
                                            persist=10, actions=("warn", "record"))),
    ("share[*] >= 0.7 for 10: stop", dict(statistic="share", selector="*", op=">=", persist=10,
                                          actions=("record", "stop"))),
    ("acc_drop > 0.1", dict(statistic="acc_drop", selector=None, threshold=0.1, persist=1)),
    ("grad_norm[evaluator] > 3x median(50)", dict(threshold=3.0, aggregate="median", window=50)),
    ("grad_norm[evaluator] > 2.5 x mean(8) cooldown 4", dict(threshold=2.5, aggregate="mean", window=8,
                                                              cooldown=4)),
    ("agent_norm[voter0] < max(5)", dict(op="<", threshold=1.0, aggregate="max", window=5)),
    ("nonfinite: checkpoint, stop", dict(statistic="nonfinite", op=None, actions=("record", "checkpoint", "stop"))),
    ("train/accuracy <= .1e1 for 3", dict(statistic="train/accuracy", threshold=1.0, persist=3)),
    ("opt.loss[voter] > 1e3", dict(statistic="opt.loss", selector="voter", threshold=1000.0)),
    ("role_cosine[*] < -0.5", dict(threshold=-0.5, op="<")),
    ("share[voter] < -1e-1 for 2", dict(threshold=-0.1, persist=2)),
    ("cosine[voter0|voter2] > 0.9", dict(statistic="cosine", selector="voter0|voter2")),
    ("role_cosine[*] < 0 for 3", dict(statistic="role_cosine", selector="*", op="<", threshold=0.0)),
])
def test_rules_parse(text, fields):
    rule = parse_rule(text)
    for name, value in fields.items():
        assert getattr(rule, name) == value, name


@pytest.mark.parametrize("text, column, token", [
    ("coherance[voter] > 0.75", 1, "unknown statistic 'coherance' (did you mean 'coherence'?)"),
    ("coherence[voter] >> 0.75", 19, "'>'"),
    ("coherence[voter > 1", 17, "'>'"),
    ("coherence[voter] > 0.75 for", 28, "end of rule"),
    ("coherence[voter] > 0.75 for 1.5", 29, "'1.5'"),
    ("coherence[voter] > 0.75 for 0", 29, "'0'"),
    ("coherence[voter] > 3x median(1)", 30, "'1'"),
    ("coherence[voter] > 3x median 5", 30, "'5'"),
    ("coherence[voter] > 3x medium(5)", 23, "'medium'"),
    ("coherence[voter] > 1 : explode", 24, "'explode'"),
    ("coherence[voter] > 1 for 2 for 3", 28, "'for'"),
    ("coherence[voter] > 1 2", 22, "'2'"),
    ("coherence > 1", 1, "'coherence' needs a role"),
    ("acc_drop[voter] > 1", 1, "'acc_drop' takes no selector"),
    ("nonfinite > 3", 11, "'>'"),
    ("coherence[voter] ~ 3", 18, "'~'"),
    ("cosine[voter0] > 0", 1, "cosine[voter0]: expected cosine[A|B]"),
    ("coherence[voter|aggregator] > 0", 1, "coherence[voter|aggregator]: expected one role"),
    ("cosine[voter0|] > 0", 15, "']'"),
    ("opt.loss > 1", 1, "'opt.loss' needs a policy"),
    ("metric.foo[voter] > 0", 1, "'metric.foo' takes no selector"),
    ("   ", 4, "empty"),
    ("eval.accuracy < \u0663", 17, "'\u0663'"),  # a digit of another script is not a number
    ("grad_norm > \u0663x median(5)", 13, "'\u0663'"),
])
def test_bad_rules_point_at_the_token(text, column, token):
    with pytest.raises(ConfigError) as err:
        parse_rule(text)
    message = str(err.value)
    assert "\n" not in message
    if token == "empty":
        assert message == f"bad alert rule {text!r}: empty"
    else:
        assert f"at column {column}, {token}" in message, message


def test_a_long_rule_is_quoted_cut_short_with_its_own_length():
    """The counts are of the rule's and the token's own characters (not of their quoted forms)."""
    for text, token in (("x" * 4996 + " > 1", "x" * 4996), ("coherence[voter] > 1 " + "y" * 4979, "y" * 4979)):
        with pytest.raises(ConfigError) as err:
            parse_rule(text)
        message = str(err.value)
        assert message.startswith("bad alert rule '" + text[:119] + "... (5,000 characters): at column "), message[:200]
        assert "'" + token[:119] + f"... ({len(token):,} characters)" in message and len(message) < 800, message


def test_rules_from_yaml(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text("alerts:\n  - coherence[voter] > 0.75 for 10\n  - {rule: 'acc_drop > 0.2: stop', name: cliff}\n")
    rules = load_rules(good)
    assert [r.statistic for r in rules] == ["coherence", "acc_drop"]
    assert rules[1].name == "cliff" and rules[1].actions == ("record", "stop")
    cases = {"bad.yaml": ("- a: [1\n", "not valid YAML (line 2"),
             "dict.yaml": ("rule: x\n", "expected a list of rules"),
             "entry.yaml": ("- acc_drop > 0.1\n- acc_drop >> 0.1\n", "entry 2: bad alert rule"),
             "shape.yaml": ("- {rule: acc_drop > 1, when: now}\n", "entry 1 must be a rule string")}
    for name, (text, expected) in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace("[", r"\[")):
            load_rules(tmp_path / name)
    with pytest.raises(ConfigError, match="cannot read alert file"):
        load_rules(tmp_path / "missing.yaml")


def test_default_rules_cover_the_three_pathologies():
    names = {r.name: r for r in DEFAULT_RULES}
    assert {"amplification", "capture", "cliff", "cliff-early", "nonfinite"} == set(names)
    assert all(set(r.actions) == {"warn", "record"} for r in DEFAULT_RULES)


# ---------------------------------------------------------------- the engine
def reference_firings(values, threshold, persist, cooldown):
    """Definition, written plainly: fire when the last `persist` observations all exceed the
    threshold and the rule is armed; re-arm after `cooldown` consecutive observations below."""
    fired, armed, below = [], True, 0
    for t in range(len(values)):
        if values[t] > threshold:
            below = 0
        else:
            below += 1
            if below >= cooldown:
                armed = True
        run = t + 1 >= persist and all(v > threshold for v in values[t + 1 - persist:t + 1])
        if armed and run:
            fired.append(t)
            armed = False
    return fired


def test_engine_matches_the_definition_on_random_streams():
    rng = random.Random(0)
    n_fired = 0
    for _ in range(300):
        persist, cooldown = rng.randint(1, 6), rng.randint(1, 6)
        # two-state chain so conditions come in episodes of varied lengths
        values, on = [], False
        for _ in range(80):
            on = (rng.random() < 0.8) == on
            values.append(rng.uniform(0.8, 1.0) if on else rng.uniform(0.0, 0.7))
        engine = AlertEngine([parse_rule(f"coherence[voter] > 0.75 for {persist} cooldown {cooldown}")])
        got = [t for t, v in enumerate(values) if engine.observe(t, {"coherence[voter]": v})]
        assert got == reference_firings(values, 0.75, persist, cooldown)
        n_fired += len(got)
    assert n_fired > 300  # the streams do exercise firing and re-arming


def test_engine_fires_once_per_episode_at_the_right_step():
    engine = AlertEngine([parse_rule("share[*] > 0.7 for 10")])
    stream = [0.5] * 20 + [0.9] * 30 + [0.5] * 5 + [0.9] * 12 + [0.5] * 10 + [0.9] * 10
    fired = [(t, a.key, a.since) for t, v in enumerate(stream, 1)
             for a in engine.observe(t, {"share[voter]": v, "share[aggregator]": 1 - v})]
    # episode 1 from step 21 fires at 30; the 5-step dip (< cooldown 10) does not re-arm; after a
    # 10-step quiet spell the episode from step 78 fires at 87
    assert fired == [(30, "share[voter]", 21), (87, "share[voter]", 78)]


def test_aggregate_threshold_and_missing_values():
    rule = parse_rule("grad_norm[evaluator] > 3x median(50)")
    engine = AlertEngine([rule])
    rng = np.random.default_rng(0)
    base = rng.uniform(0.9, 1.1, 40)
    fired = []
    for t, v in enumerate(base):
        assert not engine.observe(t, {"grad_norm[evaluator]": v})
        engine.observe(t, {"grad_norm[other]": 100.0})  # other names never reach this rule
        engine.observe(t, {"grad_norm[evaluator]": float("nan")})  # NaN: not observed
    fired = engine.observe(40, {"grad_norm[evaluator]": 3.5})
    assert len(fired) == 1
    assert fired[0].reference == pytest.approx(3 * np.median(base))
    # too little history: a jump at the 3rd value cannot fire (needs min(N, 5) previous values)
    engine = AlertEngine([rule])
    assert min_history(rule) == 5
    assert not any(engine.observe(t, {"grad_norm[evaluator]": v}) for t, v in enumerate([1, 1, 50, 1, 1]))
    assert engine.observe(5, {"grad_norm[evaluator]": 50})


def test_pair_selectors_match_either_order():
    engine = AlertEngine([parse_rule("cosine[voter1|voter0] > 0.5")])
    fired = engine.observe(1, {"cosine[voter0|voter1]": 0.9, "cosine[voter0|voter2]": 0.9})
    assert [a.key for a in fired] == ["cosine[voter0|voter1]"]


def test_interference_pairs_are_ordered_cosine_pairs_are_not():
    """interference[A|B] (A's update on B's loss) is not interference[B|A]; a cosine pair is either order."""
    assert not AlertEngine([parse_rule("interference[b|a] > 0")]).observe(1, {"interference[a|b]": 0.9})
    assert AlertEngine([parse_rule("interference[a|b] > 0")]).observe(1, {"interference[a|b]": 0.9})
    assert AlertEngine([parse_rule("update_cosine[b|a] > 0")]).observe(1, {"update_cosine[a|b]": 0.9})


def test_a_lasting_excursion_is_not_its_own_baseline():
    """`2x max(20) for 3` on a lasting 10x jump: fires on the 3rd elevated value (with the jump in
    the baseline, max would double each step and it never would)."""
    engine = AlertEngine([parse_rule("update_norm[voter] > 2x max(20) for 3")])
    values = [1.0 + 0.01 * (t % 3) for t in range(20)] + [10.0] * 10
    fired = [t for t, v in enumerate(values) if engine.observe(t, {"update_norm[voter]": v})]
    assert fired == [22]


def test_nonfinite_rule():
    engine = AlertEngine([parse_rule("nonfinite cooldown 1")])
    got = [t for t, v in enumerate([0, 0, 1, 1, 0, 1]) if engine.observe(t, {"nonfinite": v})]
    assert got == [2, 5]


# ---------------------------------------------------------------- values = the analyses' statistics
def synthetic_records(rng, n_steps):
    """IP-like records: per step three voter-policy records and one aggregator record."""
    grams, tokens, policies, steps = [], [], [], []
    for step in range(1, n_steps + 1):
        for policy, rows in (("voter", [0, 1, 2]), ("voter", [0, 1, 2]), ("aggregator", [3])):
            G = np.zeros((4, 16))
            G[rows] = rng.normal(size=(len(rows), 16)) + rng.normal(size=16)
            grams.append(G @ G.T)
            t = np.zeros(4, dtype=np.int64)
            t[rows] = rng.integers(5, 50, len(rows))
            tokens.append(t)
            policies.append(policy)
            steps.append(step)
    return np.array(grams), np.array(tokens), np.array(policies), np.array(steps)


@pytest.mark.parametrize("shared", [False, True])
def test_step_values_equal_the_analyses(shared):
    rng = np.random.default_rng(1)
    gram, tokens, policies, steps = synthetic_records(rng, 12)
    if shared:
        policies[:] = "shared"
        gram = gram + 0.1 * np.eye(4)  # every role present in every record
    series = RunSeries(AGENTS, ROLES, gram, steps, policies, tokens)
    sv = StepValues(AGENTS, ROLES)
    for i, step in enumerate(series.steps):
        m = steps == step
        v = sv.records(gram[m], tokens[m], list(policies[m]))
        for j, role in enumerate(series.roles):
            assert v[f"grad_norm[{role}]"] == pytest.approx(series.role_norm[i, j], rel=1e-12)
        assert v["coherence[voter]"] == pytest.approx(series.coherence[i, 0], rel=1e-12)
        assert v["amplification[voter]"] == pytest.approx(series.amplification[i, 0], rel=1e-12)
        for a, b in [(0, 1), (0, 2), (1, 2), (0, 3)]:
            expected = series.agent_cosine[i, a, b]
            key = f"cosine[{AGENTS[a]}|{AGENTS[b]}]"
            if np.isnan(expected):  # IP: a voter and the aggregator never share a record
                assert np.isnan(v[key]) and not shared
            else:
                assert v[key] == pytest.approx(expected, rel=1e-12)
        assert "coherence[aggregator]" not in v  # one agent: no coherence
        if shared:
            st = series.set_stats("shared")
            for j, role in enumerate(st["roles"]):
                assert v[f"share[{role}]"] == pytest.approx(st["share"][i, j], rel=1e-12)
                assert v[f"per_token_share[{role}]"] == pytest.approx(st["per_token_share"][i, j], rel=1e-12)
        else:
            assert not any(k.startswith("share[") for k in v)  # no shared parameter set in IP


def test_only_wanted_statistics_are_computed():
    rng = np.random.default_rng(2)
    gram, tokens, policies, steps = synthetic_records(rng, 1)
    full = StepValues(AGENTS, ROLES).records(gram, tokens, list(policies))
    some = StepValues(AGENTS, ROLES, wanted={"coherence", "opt.loss"}).records(
        gram, tokens, list(policies), [{"loss": 1.0, "lr": 0.1}] * len(gram))
    assert set(some) == {"nonfinite", "coherence[voter]", "opt.loss[voter]", "opt.loss[aggregator]"}
    assert some["coherence[voter]"] == full["coherence[voter]"]


def test_policy_metrics_are_named_before_any_record():
    """SP with --probe none: update_rel/shared must be update_rel[shared] from the first step."""
    sv = StepValues(AGENTS, ROLES, policies=["shared"])
    assert sv.metrics({"update_rel/shared": 0.2})["update_rel[shared]"] == 0.2


def test_without_token_counts_there_are_no_token_shares():
    rng = np.random.default_rng(4)
    gram, _, _, _ = synthetic_records(rng, 1)
    v = StepValues(AGENTS, ROLES).records(gram + 0.1 * np.eye(4), None, ["shared"] * len(gram))
    assert "share[voter]" in v and "token_share[voter]" not in v and "per_token_share[voter]" not in v


def test_eval_values_smooth_like_the_cliff_detector():
    sv = StepValues(AGENTS, ROLES)
    accs = [0.5, 0.6, 0.3, 0.6, 0.4, 0.3, 0.2]
    values = [sv.evals({"accuracy": a}) for a in accs]
    assert [v["accuracy"] for v in values] == accs
    assert "acc_drop" not in values[0] and "acc_drop" not in values[1]  # a median of two would be their mean
    # from the third on, running median of the last 3: .5 .6 .4 .4 .3; running peak .5 .6 .6 .6 .6
    assert [v["acc_drop"] for v in values[2:]] == pytest.approx([0, 0, 0.2, 0.2, 0.3])
    assert sv.evals({"accuracy": 0.2, "length/voter": 7.0})["eval.length[voter]"] == 7.0


@pytest.mark.parametrize("outlier", [1, 3])
def test_one_bad_evaluation_is_never_a_cliff(outlier):
    """0.60, 0.35, 0.60, ...: the second evaluation's outlier made acc_drop 0.125 (the mean of two), so the default
    cliff rule fired where the cliff detector (and the same outlier placed later) saw nothing."""
    accs = [0.60, 0.60, 0.60, 0.61, 0.60, 0.62]
    accs[outlier] = 0.35
    sv, engine = StepValues(AGENTS, ROLES), AlertEngine([r for r in DEFAULT_RULES if r.statistic == "acc_drop"])
    assert engine.rules
    assert not [t for t, a in enumerate(accs) if engine.observe(t, sv.evals({"accuracy": a}))]


@pytest.mark.parametrize("order", [("setA", "setB"), ("setB", "setA")])
def test_a_role_training_two_shared_sets_gets_its_largest_share(order):
    """share[voter] was whichever set's record came last in the step (0.43 or 0.98): `share[*] > 0.7` missed a
    voter capture of set A whenever set B's record followed."""
    rng = np.random.default_rng(0)
    g = rng.normal(size=(4, 16))
    dominated = g.copy()
    dominated[3] *= 0.05                     # set A: the aggregator's gradient is tiny
    records = {"setA": dominated @ dominated.T, "setB": g @ g.T}
    v = StepValues(AGENTS, ROLES).records(np.stack([records[p] for p in order]), np.ones((2, 4)), list(order))
    shares = {p: StepValues(AGENTS, ROLES).records(records[p][None], np.ones((1, 4)), [p])["share[voter]"]
              for p in records}
    assert shares["setA"] > 0.9 and shares["setB"] < shares["setA"]
    assert v["share[voter]"] == pytest.approx(shares["setA"])


@pytest.mark.parametrize("loss, fires", [(float("nan"), False), (float("inf"), True)])
def test_a_nan_scalar_is_not_logged_an_infinite_one_is_nonfinite(loss, fires):
    """Monitor (the trainer, verl) counted a NaN scalar as non-finite, where watch drops it as not logged."""
    v = StepValues(AGENTS, ROLES).records(np.eye(4)[None], np.ones((1, 4)), ["all"], [{"loss": loss}])
    assert v["nonfinite"] == float(fires)


# ---------------------------------------------------------------- actions
def test_monitor_actions_and_events(tmp_path):
    meta = RunMeta(agents=AGENTS, agent_roles=ROLES, roles=["voter", "aggregator"], policies=["voter", "aggregator"])
    lines, saved, stopped = [], [], []
    rules = [parse_rule("coherence[voter] > 0.9 for 2: warn, checkpoint"), parse_rule("acc_drop > 0.1: stop"),
             parse_rule("grad_norm[aggregator] > 5")]
    with RunWriter(tmp_path / "r.h5", meta) as writer:
        mon = Monitor(rules, AGENTS, ROLES, policies=["voter", "aggregator"], writer=writer,
                      checkpoint=lambda a: saved.append(a.step) or f"ckpt{a.step}",
                      stop=lambda a: stopped.append(a.step), echo=lines.append)
        same = np.ones((4, 4))
        same[3, :3] = same[:3, 3] = 0
        for step in (1, 2, 3):
            mon.step(step, same[None], np.ones((1, 4)), ["voter"])
        for step, acc in ((3, 0.5), (4, 0.5), (5, 0.5), (6, 0.2), (7, 0.2)):
            mon.evals(step, {"accuracy": acc})
        # medians of the last 3 from the third evaluation: .5 .5 .5 .2 — a drop of .3 at step 7 (not at 6)
        assert mon.stop_requested is not None and mon.stop_requested.step == 7
    assert saved == [2] and stopped == [7]
    assert any("checkpoint saved to ckpt2" in line for line in lines)
    events = open_run(tmp_path / "r.h5").events
    assert events["kind"].tolist() == ["alert", "checkpoint", "alert"]
    assert events["step"].tolist() == [2, 2, 7]
    assert "coherence[voter] = 1 > 0.9" in events["message"][0]


def test_monitor_rejects_unknown_selectors():
    for text, expected in [("coherence[votr] > 1", "unknown role 'votr'"),
                           ("agent_norm[voter] > 1", "unknown agent 'voter'"),
                           ("update_norm[shared] > 1", "unknown policy 'shared'"),
                           ("opt.loss[x] > 1", "unknown policy 'x'"),
                           ("cosine[voter0|voter9] > 1", "'voter9' is not a pair"),
                           ("role_cosine[voter|voter] > 1", "'voter|voter' is not a pair"),
                           ("eval.length[nobody] > 1", "unknown role, agent or policy 'nobody'"),
                           ("eval.accuracy[voter|aggregator] > 0", "unknown role, agent or policy 'voter|aggregator'")]:
        with pytest.raises(ConfigError, match=expected):
            Monitor([parse_rule(text)], AGENTS, ROLES, policies=["voter", "aggregator"])


# ---------------------------------------------------------------- gradscope watch, live
WRITER = textwrap.dedent("""
    import sys, time
    import numpy as np
    from gradscope.runfile import RunMeta, RunWriter
    agents = ["voter0", "voter1", "voter2", "aggregator"]
    meta = RunMeta(agents=agents, agent_roles=["voter"] * 3 + ["aggregator"], roles=["voter", "aggregator"])
    rng = np.random.default_rng(0)
    with RunWriter(sys.argv[1], meta, flush_every=2) as w:
        w.log_eval(0, {"accuracy": 0.5})
        for step in range(1, 41):
            shared = 3.0 if step >= 20 else 0.0      # the voters align from step 20
            G = rng.normal(size=(4, 32)) + shared * np.ones(32)
            w.log_step(step, G @ G.T, np.full(4, 10))
            w.log_metrics(step, {"update_norm/voter": 0.1})
            if step % 10 == 0:
                w.log_eval(step, {"accuracy": 0.5})
            time.sleep(0.1)
    print("writer done", flush=True)
""")


def test_watch_follows_a_live_writer(tmp_path):
    run = tmp_path / "live.h5"
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    writer = subprocess.Popen([sys.executable, str(script), str(run)], stdout=subprocess.PIPE, text=True)
    try:
        # started at once: --wait covers the writer's start-up before the file exists
        watch = subprocess.Popen([*GRADSCOPE, "watch", str(run), "--wait", "60", "--poll", "0.1", "--no-default-alerts",
                                  "--alert", "coherence[voter] > 0.9 for 5"], stdout=subprocess.PIPE, text=True)
        first = watch.stdout.readline()
        assert first.startswith("watching") and writer.poll() is None  # following live, not replaying
        rest, _ = watch.communicate(timeout=120)
        assert writer.wait(timeout=60) == 0
    finally:
        writer.kill()
    assert watch.returncode == 0
    out = [first.rstrip("\n"), *rest.splitlines()]
    alerts = [line for line in out if "alert at step" in line]
    assert len(alerts) == 1 and "alert at step 24:" in alerts[0], out  # aligned from 20, for 5 → 24
    assert out[-1].startswith(f"writer closed {run} (last step 40): 1 alerts")


RESUMING_WRITER = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    from gradscope.runfile import RunMeta, RunWriter
    path, resume = sys.argv[1], sys.argv[2] == "resume"
    rng = np.random.default_rng(1 if resume else 0)

    def log(w, step):  # the voters align from step 8 of the resumed run only
        G = rng.normal(size=(4, 32)) + (3.0 if resume and step >= 8 else 0.0) * np.ones(32)
        w.log_step(step, G @ G.T, np.full(4, 10))
        w.flush()
        time.sleep(0.05)

    if resume:
        with RunWriter.resume(path, keep_below_step=6) as w:
            for step in range(6, 13):
                log(w, step)
    else:
        meta = RunMeta(agents=["v1", "v2", "v3", "agg"], agent_roles=["voter"] * 3 + ["aggregator"],
                       roles=["voter", "aggregator"])
        w = RunWriter(path, meta, flush_every=1)
        for step in range(1, 11):
            log(w, step)
        os._exit(0)  # killed: the file is never closed
""")


def test_watch_follows_a_resumed_run_to_its_end(tmp_path):
    """--resume renames a new file over the path: watch switches to it (it polled the deleted file for ever),
    replays the kept steps muted and fires on the resumed steps."""
    run, script = tmp_path / "run.h5", tmp_path / "writer.py"
    script.write_text(RESUMING_WRITER)
    assert subprocess.run([sys.executable, str(script), str(run), "new"], timeout=120).returncode == 0
    watch = subprocess.Popen([*GRADSCOPE, "watch", str(run), "--poll", "0.05", "--no-default-alerts",
                              "--alert", "coherence[voter] > 0.9 for 3"], stdout=subprocess.PIPE, text=True)
    try:
        assert watch.stdout.readline().startswith("watching")
        time.sleep(1.0)
        assert watch.poll() is None  # the killed file: still waiting
        assert subprocess.run([sys.executable, str(script), str(run), "resume"], timeout=120).returncode == 0
        rest, _ = watch.communicate(timeout=60)
    finally:
        watch.kill()
    assert watch.returncode == 0, rest
    lines = rest.splitlines()
    assert f"{run} was replaced: following the new file from step 6" in lines
    assert [line.split(":")[0] for line in lines if "alert at step" in line] == ["gradscope alert at step 10"]
    assert lines[-1] == f"writer closed {run} (last step 12): 1 alerts"


def test_watch_replays_a_finished_run_like_the_monitor(tmp_path):
    """watch on a closed file fires on the same steps as a Monitor fed while writing."""
    rng = np.random.default_rng(3)
    gram, tokens, policies, steps = synthetic_records(rng, 30)
    gram[steps >= 12] *= 50  # a norm jump
    meta = RunMeta(agents=AGENTS, agent_roles=ROLES, roles=["voter", "aggregator"], policies=["voter", "aggregator"])
    rules = [parse_rule("grad_norm[*] > 4x median(10)"), parse_rule("acc_drop > 0.05")]
    live = Monitor(rules, AGENTS, ROLES, policies=["voter", "aggregator"], echo=lambda s: None)
    with RunWriter(tmp_path / "r.h5", meta) as w:
        for step in range(1, 31):
            m = steps == step
            for g, t, p in zip(gram[m], tokens[m], policies[m]):
                w.log_step(step, g, t, policy=p)
            live.step(step, gram[m], tokens[m], list(policies[m]))
            if step % 5 == 0:
                w.log_eval(step, {"accuracy": 0.5 - 0.02 * step})
                live.evals(step, {"accuracy": 0.5 - 0.02 * step})
    from gradscope.alerts.watch import watch
    replay = watch(str(tmp_path / "r.h5"), rules, poll=0.01, echo=lambda s: None)
    assert [(a.step, a.key) for a in replay] == [(a.step, a.key) for a in live.fired]
    assert (12, "grad_norm[voter]") in [(a.step, a.key) for a in replay]


def test_unlogged_scalars_are_not_nonfinite(tmp_path):
    meta = RunMeta(agents=AGENTS, agent_roles=ROLES, roles=["voter", "aggregator"], scalar_names=["loss", "kl"])
    with RunWriter(tmp_path / "r.h5", meta) as w:
        for step in (1, 2, 3):
            w.log_step(step, np.eye(4), np.ones(4), scalars={"loss": 0.5})  # kl not logged: stored NaN
    from gradscope.alerts.watch import watch
    fired = watch(str(tmp_path / "r.h5"), [parse_rule("nonfinite"), parse_rule("opt.loss[*] > 0.1")],
                  poll=0.01, echo=lambda s: None)
    assert [(a.rule.statistic, a.step) for a in fired] == [("opt.loss", 1)]


def test_catch_up_restores_the_rules_state(tmp_path):
    """A resumed run's monitor continues from the kept steps: the accuracy peak before the resume
    point still counts, and nothing is acted on while catching up."""
    from gradscope.alerts.watch import catch_up

    meta = RunMeta(agents=AGENTS, agent_roles=ROLES, roles=["voter", "aggregator"])
    with RunWriter(tmp_path / "r.h5", meta) as w:
        for step, acc in ((0, 0.6), (1, 0.6), (2, 0.6), (3, 0.1)):
            w.log_step(step, np.eye(4), np.ones(4)) if step else None
            w.log_eval(step, {"accuracy": acc})
    rule = parse_rule("acc_drop > 0.1: stop")
    lines: list[str] = []
    resumed = Monitor([rule], AGENTS, ROLES, echo=lines.append, stop=lambda a: None)
    catch_up(str(tmp_path / "r.h5"), resumed, below_step=3)  # keeps steps 0-2 (peak 0.6)
    assert not resumed.fired and not lines and resumed.stop_requested is None
    for acc in (0.3, 0.3):
        resumed.evals(3, {"accuracy": acc})
    fresh = Monitor([rule], AGENTS, ROLES, echo=lines.append)
    for acc in (0.3, 0.3):
        fresh.evals(3, {"accuracy": acc})
    assert len(resumed.fired) == 1 and resumed.stop_requested is not None and not fresh.fired


def test_catch_up_after_a_kill_keeps_the_checkpointed_last_step(tmp_path):
    """A writer killed right after the checkpoint of step 2 leaves a file not closed whose last step is 2: a
    live reader must wait for more of it, but a resume from that checkpoint vouches for it, so catching
    up feeds step 2 too (its evaluation was dropped: a cliff alert the uninterrupted run fires was lost)."""
    import h5py

    from gradscope.alerts.watch import catch_up
    from gradscope.runfile import schema

    meta = RunMeta(agents=AGENTS, agent_roles=ROLES, roles=["voter", "aggregator"])
    path = tmp_path / "r.h5"
    with RunWriter(path, meta) as w:
        for step, acc in ((0, 0.6), (1, 0.6), (2, 0.3)):
            w.log_step(step, np.eye(4), np.ones(4)) if step else None
            w.log_eval(step, {"accuracy": acc})
    with h5py.File(path, "r+") as f:  # as a SIGKILL leaves it: every row committed, the file not closed
        committed = f[schema.COMMITTED][...]
        committed[schema.COMMITTED_FIELDS.index("closed")] = 0
        f[schema.COMMITTED][...] = committed
    rule = parse_rule("acc_drop > 0.1")
    resumed = Monitor([rule], AGENTS, ROLES, echo=lambda line: None)
    catch_up(str(path), resumed, below_step=3)
    fresh = Monitor([rule], AGENTS, ROLES, echo=lambda line: None)
    for step, acc in ((0, 0.6), (1, 0.6), (2, 0.3)):
        fresh.evals(step, {"accuracy": acc})
    resumed.evals(3, {"accuracy": 0.3})
    fresh.evals(3, {"accuracy": 0.3})
    assert [a.step for a in resumed.fired] == [a.step for a in fresh.fired] == [3]
    with open_run(path) as run:  # a plain reader still waits for the writer on the last step
        follower = Follower(run, Monitor([rule], AGENTS, ROLES, echo=lambda line: None))
        follower.poll()
        assert not run.closed and follower.last_step == 1


@pytest.mark.parametrize("args, expected", [
    (["--alert", "coherence[voter] >> 1"], "at column 19"),
    (["--alerts", "missing.yaml"], "cannot read alert file"),
    (["--alert", "coherence[votr] > 1"], "unknown role 'votr'"),
    (["--poll", "0"], "argument --poll: must be a finite number in (0, 86400]"),
])
def test_watch_bad_input_is_one_line_exit_2(tmp_path, args, expected):
    run = tmp_path / "r.h5"
    with RunWriter(run, RunMeta(agents=AGENTS, agent_roles=ROLES, roles=["voter", "aggregator"])) as w:
        w.log_step(1, np.eye(4), np.ones(4))
    proc = subprocess.run([*GRADSCOPE, "watch", str(run), *args], capture_output=True, text=True,
                          timeout=60, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and expected in proc.stderr, proc.stderr
    missing = subprocess.run([*GRADSCOPE, "watch", str(tmp_path / "nope.h5")], capture_output=True, text=True)
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1


def test_watch_on_a_closed_file_without_steps_says_so(tmp_path):
    """It said '(last step -1)'."""
    from gradscope.alerts.watch import watch

    meta = RunMeta(agents=AGENTS, agent_roles=ROLES, roles=["voter", "aggregator"], policies=["voter", "aggregator"])
    with RunWriter(tmp_path / "r.h5", meta):
        pass
    out: list[str] = []
    watch(str(tmp_path / "r.h5"), [parse_rule("acc_drop > 0.05")], poll=0.01, echo=out.append)
    assert out[-1] == f"writer closed {tmp_path / 'r.h5'} (no step): 0 alerts"


def test_watch_idle_ends_when_the_file_was_replaced_by_one_it_cannot_read(tmp_path):
    """A replacement watch cannot open (not HDF5, newer schema, locked) kept it retrying for ever, --idle or not."""
    import threading

    from gradscope.alerts.watch import watch

    run, script = tmp_path / "run.h5", tmp_path / "writer.py"
    script.write_text(RESUMING_WRITER)
    assert subprocess.run([sys.executable, str(script), str(run), "new"], timeout=120).returncode == 0  # killed
    lines: list[str] = []
    follower = threading.Thread(target=watch, args=(str(run), []), kwargs=dict(poll=0.05, idle=1.0, echo=lines.append),
                                daemon=True)
    follower.start()
    time.sleep(0.5)
    garbage = tmp_path / "garbage"
    garbage.write_bytes(b"not a run file" * 1000)
    garbage.replace(run)
    follower.join(timeout=15)
    assert not follower.is_alive() and lines[-1].startswith(f"nothing new in {run} for 1 s"), lines


def test_watch_started_with_sigint_ignored_still_stops_on_it(tmp_path):
    """`nohup` or `&` in a script start a process with SIGINT ignored: watch put Python's handler back only
    when it found one, so it never stopped on SIGINT."""
    import signal

    run, script = tmp_path / "run.h5", tmp_path / "writer.py"
    script.write_text(RESUMING_WRITER)
    assert subprocess.run([sys.executable, str(script), str(run), "new"], timeout=120).returncode == 0  # killed
    watch = subprocess.Popen([*GRADSCOPE, "watch", str(run), "--poll", "0.05"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        assert watch.stdout.readline().startswith("watching")
        watch.send_signal(signal.SIGINT)
        _, err = watch.communicate(timeout=30)
    finally:
        watch.kill()
    assert watch.returncode == 130 and err.strip() == "gradscope: interrupted", err
