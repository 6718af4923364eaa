"""Capture by update share, the gradient-vs-update summary, ``plot updates`` and the update alert
statistics on synthetic runs with known shares."""
from __future__ import annotations

import json

import numpy as np
import pytest

from gradscope.alerts import parse_rule
from gradscope.alerts.watch import watch
from gradscope.analyses.cli import load
from gradscope.analyses.report import analyze_series, to_json, to_markdown
from gradscope.cli import main
from gradscope.errors import ConfigError
from gradscope.figures.updates import updates_figure
from tests.analyses.update_runs import write_update_run


def captures(path):
    series, _ = load(str(path))
    return [f for f in analyze_series(series).findings if f.kind == "capture"], series


def test_capture_found_by_update_share_alone(tmp_path):
    """Gradient share 0.55 throughout; from step 11 AdamW gives the voters 85 % of the update."""
    found, _ = captures(write_update_run(tmp_path / "u.h5", update_share=lambda t: 0.85 if t > 10 else 0.5))
    assert len(found) == 1
    f = found[0]
    assert f.role == "voter" and f.onset == 11 and f.evidence["measured_by"] == "update share"
    expected = np.mean([0.85 if t > 10 else 0.5 for t in range(f.start, f.end + 1)])  # over the episode's steps
    assert f.evidence["mean_update_share"] == pytest.approx(expected, abs=1e-6)
    assert f.evidence["mean_share"] == pytest.approx(0.55, abs=1e-6)
    assert f.evidence["update_minus_gradient_share"] == pytest.approx(expected - 0.55, abs=1e-6)
    assert f"update share {expected:.2f}, gradient share 0.55" in f.summary


def test_gradient_share_finding_reports_the_update_share_once(tmp_path):
    found, _ = captures(write_update_run(tmp_path / "g.h5", grad_share=0.8, update_share=lambda t: 0.75))
    assert len(found) == 1 and found[0].evidence["measured_by"] == "gradient share" and found[0].onset == 1
    assert found[0].evidence["mean_update_share"] == pytest.approx(0.75, abs=1e-6)
    none, _ = captures(write_update_run(tmp_path / "n.h5", update_share=lambda t: 0.5))
    assert none == []


def test_update_share_steps_past_a_gradient_share_episode_are_a_finding(tmp_path):
    """Gradient share 0.8 to step 15, then 0.55; update share 0.85 from step 10 to 60. The update channel's
    steps after the gradient episode were dropped with the whole update episode, as it overlapped."""
    path = write_update_run(tmp_path / "o.h5", steps=60, grad_share=lambda t: 0.8 if t <= 15 else 0.55,
                            update_share=lambda t: 0.85 if t >= 10 else 0.5)
    found, _ = captures(path)
    assert [(f.evidence["measured_by"], f.start, f.end) for f in found] == [
        ("gradient share", 1, 17), ("update share", 18, 60)]
    assert found[1].onset == 18 and found[1].evidence["mean_update_share"] == pytest.approx(0.85, abs=1e-6)


def test_fail_on_ignores_info_findings(tmp_path, capsys):
    """Three voters write 90 % of the tokens: a capture by token count alone (info), present in every healthy
    Voting run; --fail-on capture failed on it."""
    path = write_update_run(tmp_path / "t.h5", grad_share=0.8, update_share=lambda t: 0.75)
    found, _ = captures(path)
    assert [(f.severity, f.evidence["explained_by"]) for f in found] == [("info", "token count")]
    assert main(["analyze", str(path), "--fail-on", "capture"]) == 0
    capsys.readouterr()


def test_summary_compares_gradient_and_update(tmp_path):
    path = write_update_run(tmp_path / "s.h5", update_share=lambda t: 0.3)
    series, _ = load(str(path))
    report = analyze_series(series)
    u = report.summary["updates"]
    assert u["shared_sets"]["shared"]["voter"] == pytest.approx({"gradient_share": 0.55, "update_share": 0.3})
    # mass shares of the per-step role norms: sqrt(.55) / (sqrt(.55) + sqrt(.45)), update likewise
    assert u["roles"]["voter"]["gradient_mass_share"] == pytest.approx(np.sqrt(.55) / (np.sqrt(.55) + np.sqrt(.45)))
    assert u["roles"]["aggregator"]["update_mass_share"] == pytest.approx(np.sqrt(.7) / (np.sqrt(.3) + np.sqrt(.7)),
                                                                            rel=1e-5)
    assert "gradient → update share in 'shared': voter 0.55 → 0.30" in to_markdown(report)
    assert json.loads(to_json(report))["summary"]["updates"]["roles"]["voter"]["update_norm"] > 0
    ip, _ = load(str(write_update_run(tmp_path / "ip.h5", update_share=lambda t: 0.3, policy="ip")))
    u_ip = analyze_series(ip).summary["updates"]
    assert u_ip["shared_sets"] == {} and u_ip["roles"]["aggregator"]["update_mass_share"] == pytest.approx(
        np.sqrt(.7) / (np.sqrt(.3) + np.sqrt(.7)), rel=1e-5)


def test_updates_figure_and_command(tmp_path, capsys):
    sp = write_update_run(tmp_path / "sp.h5", update_share=lambda t: 0.3)
    fig = updates_figure(str(sp))
    labels = {ax.get_label() for ax in fig.axes}
    assert {"mass-shares", "shares:shared", "interference"} <= labels
    heat = next(ax for ax in fig.axes if ax.get_label() == "interference")
    # mean interference of the voter's part on the voters' loss: -<Δθ_voter, g_voter> = -1e-3·sqrt(.3·.55)
    texts = {t.get_text() for t in heat.texts}
    assert f"{-1e-3 * np.sqrt(0.3 * (1 - 1e-6) * 0.55):.2g}" in texts
    ip = updates_figure(str(write_update_run(tmp_path / "ip.h5", update_share=lambda t: 0.3, policy="ip")))
    assert not any(ax.get_label().startswith("shares:") for ax in ip.axes)
    assert main(["plot", "updates", str(sp), "--out", str(tmp_path / "fig")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "fig.png")


def test_updates_figure_leaves_steps_without_gradient_as_gaps(tmp_path):
    """No gradient at steps 10-12: the signed gradient share there is no measurement (a gap, as in the
    cliffs and shares figures), not a share of 0."""
    path = write_update_run(tmp_path / "z.h5", update_share=lambda t: 0.3, no_gradient=lambda t: 10 <= t <= 12)
    ax = next(ax for ax in updates_figure(str(path)).axes if ax.get_label() == "shares:shared")
    line = next(line for line in ax.get_lines() if line.get_label() == "voter gradient")
    x, y = (np.asarray(v, dtype=float) for v in line.get_data())
    assert np.isnan(y[(x >= 10) & (x <= 12)]).all() and not (y == 0).any()
    assert y[x == 9] == pytest.approx(0.55)


def test_interference_matrix_is_the_mean_over_records(tmp_path):
    """Step 1 has three records, step 2 one with a 10× larger update: the figure's cell is the mean of
    the four records (docs/figures.md), not the mean of the two per-step means."""
    from gradscope.runfile import RunMeta, RunWriter
    from tests.analyses.update_runs import AGENTS, ROLES, components

    e = np.eye(16)
    meta = RunMeta(agents=AGENTS, agent_roles=ROLES, policies=["shared"], update_unit="role",
                   config={"workflow": "voting", "task": "math", "model": "testbed", "policy": "sp"})
    G = np.stack([0.5 * e[0] / 3] * 3 + [0.5 * e[1]])
    values = []
    with RunWriter(tmp_path / "r.h5", meta) as w:
        for step, scale in ((1, 1e-3), (1, 1e-3), (1, 1e-3), (2, 1e-2)):
            D = scale * components(0.6)
            values.append(float(-(D @ G.T)[0, :3].sum()))  # <Δθ_voter, g_voter>
            update = type("U", (), dict(gram=D @ D.T, interference=-(D @ G.T), grad_scale=1.0, residual=0.0))
            w.log_step(step, G @ G.T, [30, 30, 30, 10], policy="shared", update=update)
    heat = next(ax for ax in updates_figure(str(tmp_path / "r.h5")).axes if ax.get_label() == "interference")
    cell = next(t for t in heat.texts if t.get_position() == (0, 0)).get_text()
    assert cell == f"{np.mean(values):.2g}" != f"{(values[0] + values[3]) / 2:.2g}"


def test_updates_figure_needs_update_attribution(tmp_path, capsys):
    from tests.figures.conftest import write_run

    plain = write_run(tmp_path / "plain.h5")
    with pytest.raises(ConfigError, match="no update attribution"):
        updates_figure(str(plain))
    assert main(["plot", "updates", str(plain)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gradscope: error: updates:")


def test_alert_statistics_match_the_analyses(tmp_path):
    """``watch`` on the file: update_share[voter] fires when the analyses' per-step update share crosses 0.7,
    and role_update_norm / update_share_gap / interference values equal the RunSeries ones."""
    path = write_update_run(tmp_path / "a.h5", update_share=lambda t: 0.85 if t > 10 else 0.5)
    fired = watch(str(path), [parse_rule("update_share[voter] > 0.7 for 3"),
                              parse_rule("update_share_gap[voter] > 0.25"),
                              parse_rule("interference[voter|aggregator] > 1"),
                              parse_rule("role_update_norm[aggregator] < 1e-9")], poll=0, echo=lambda _: None)
    assert [(a.rule.statistic, a.step) for a in fired] == [("update_share_gap", 11), ("update_share", 13)]
    assert fired[0].value == pytest.approx(0.30, abs=1e-5) and fired[1].value == pytest.approx(0.85, abs=1e-5)
    from gradscope.alerts.values import StepValues

    series, _ = load(str(path))
    values = StepValues(series.agents, series.agent_roles, update_unit="role")
    out = values.records(series.gram[:1], series.tokens[:1], ["shared"], None, series.update_gram[:1],
                         series.update_interference[:1])
    assert out["role_update_norm[voter]"] == pytest.approx(series.role_update_norm[0, 0])
    assert out["interference[aggregator|voter]"] == pytest.approx(series.role_interference[0, 1, 0])
    assert out["update_cosine[voter|aggregator]"] == pytest.approx(0.0, abs=1e-12)
