"""Dashboards: ``gradscope export`` and ``gradscope train --log-to``, read back with each dashboard's reader."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from gradscope.cli import main
from gradscope.errors import ConfigError
from gradscope.integrations.scalars import scalar_name
from gradscope.integrations.sinks import open_sink
from gradscope.runfile import RunMeta, RunWriter, open_run
from tests.figures.conftest import write_run
from tests.integrations import readback


@pytest.fixture(scope="module")
def ip_run(tmp_path_factory):
    """The figures' synthetic IP cliff run (voter and aggregator records per step) plus two alert events."""
    path = write_run(tmp_path_factory.mktemp("sinks") / "ip.h5", policy="ip", cliff=True)
    with RunWriter.resume(path, keep_below_step=10**9) as w:
        w.log_event(5, "alert", "coherence[voter] = 0.9 > 0.75", severity="warning")
        w.log_event(7, "alert", "share[aggregator] = 0.8 > 0.7", severity="critical")
    return path


def expected(path, step: int) -> dict[str, float]:
    """A few statistics of one step by hand from the stored Grams (independent of gradscope.stats)."""
    with open_run(path) as r:
        rows = np.flatnonzero(r.step == step)
        grams, policies = r.gram[rows], r.policy[rows]
        metrics, evals = r.metrics, r.evals
    (voter,) = [M for M, p in zip(grams, policies) if p == "voter"]
    (agg,) = [M for M, p in zip(grams, policies) if p == "aggregator"]
    out = {"gradscope/grad_norm": np.mean([np.sqrt(M.sum()) for M in grams]),
           "gradscope/norm/voter": np.sqrt(voter[:3, :3].sum()),
           "gradscope/norm/aggregator": np.sqrt(agg[3, 3]),
           "gradscope/agent_norm/voter1": np.sqrt(voter[1, 1]),
           "gradscope/cos/voter0/voter2": voter[0, 2] / np.sqrt(voter[0, 0] * voter[2, 2]),
           "gradscope/coherence/voter": np.sqrt(voter[:3, :3].sum()) / np.sqrt(np.diag(voter)[:3]).mean() / 3,
           "gradscope/share/aggregator": 1.0}  # IP: the aggregator's record holds only its own gradient
    out.update({f"gradscope/{n}": v for s, n, v in zip(metrics["step"], metrics["name"], metrics["value"]) if s == step})
    out.update({f"gradscope/eval/{n}": v for s, n, v in zip(evals["step"], evals["name"], evals["value"]) if s == step})
    return out


def _check(values: dict[str, dict[int, float]], path, steps=(4, 20)) -> None:
    for step in steps:
        for name, value in expected(path, step).items():
            assert values[name][step] == pytest.approx(value, rel=1e-5), (name, step)
    assert "gradscope/eval/accuracy" in values and "gradscope/update_norm/voter" in values


def _export(run, to, dest, capsys) -> str:
    assert main(["export", str(run), "--to", to, str(dest)]) == 0
    return capsys.readouterr().out


def test_export_tensorboard(ip_run, tmp_path, capsys):
    assert "findings" in _export(ip_run, "tensorboard", tmp_path, capsys)
    _check(readback.tensorboard_scalars(tmp_path), ip_run)
    texts = readback.tensorboard_texts(tmp_path)
    assert "coherence[voter]" in texts["gradscope/events"][5] and "[critical]" in texts["gradscope/events"][7]
    assert "cliff" in next(iter(texts["gradscope/findings"].values()))


def test_a_second_tensorboard_export_into_one_folder_is_refused(ip_run, tmp_path, capsys):
    """TensorBoard draws a folder's event files as one run: a second export put every point there twice."""
    _export(ip_run, "tensorboard", tmp_path, capsys)
    files = sorted(tmp_path.glob("events.out.tfevents.*"))
    assert main(["export", str(ip_run), "--to", "tensorboard", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"gradscope: error: {tmp_path} already holds TensorBoard event files (TensorBoard would draw "
                   f"them and this run's as one series): give an empty or new folder")
    assert sorted(tmp_path.glob("events.out.tfevents.*")) == files


def test_a_metric_named_like_a_statistic_never_replaces_it(ip_run, tmp_path, capsys):
    """TRL logs its own ``grad_norm``: exported beside the statistic as gradscope/metric/grad_norm."""
    import shutil

    run = tmp_path / "run.h5"
    shutil.copy(ip_run, run)
    with RunWriter.resume(run, keep_below_step=10**9) as w:
        w.log_metrics(4, {"grad_norm": 123.0, "norm/voter": 7.0})
    _export(run, "tensorboard", tmp_path / "tb", capsys)
    values = readback.tensorboard_scalars(tmp_path / "tb")
    want = expected(ip_run, 4)
    assert values["gradscope/grad_norm"][4] == pytest.approx(want["gradscope/grad_norm"], rel=1e-5)
    assert values["gradscope/norm/voter"][4] == pytest.approx(want["gradscope/norm/voter"], rel=1e-5)
    assert values["gradscope/metric/grad_norm"][4] == 123.0 and values["gradscope/metric/norm/voter"][4] == 7.0


def test_export_wandb_offline(ip_run, tmp_path, capsys):
    _export(ip_run, "wandb", tmp_path, capsys)
    history = readback.wandb_history(tmp_path / "wandb")  # DEST/wandb/offline-run-*
    _check(history, ip_run)
    assert "share[aggregator]" in history["gradscope/events"][7]
    assert "cliff" in next(iter(history["gradscope/findings"].values()))


def test_export_mlflow_local_store(ip_run, tmp_path, capsys):
    _export(ip_run, "mlflow", tmp_path, capsys)
    _check(readback.mlflow_metrics(tmp_path), ip_run)
    texts = readback.mlflow_texts(tmp_path)
    assert "step 5: [warning] alert: coherence[voter]" in texts["gradscope/events.txt"]
    assert "cliff" in texts["gradscope/findings.txt"]


def test_mlflow_text_is_there_while_the_run_goes_on(tmp_path):
    """An alert shows in MLflow when it fires, not only once the run closes (a killed run lost them all)."""
    sink = open_sink("mlflow", tmp_path, run_name="r", config={})
    sink.text(3, "gradscope/events", ["[warning] alert: a"])
    assert readback.mlflow_texts(tmp_path) == {"gradscope/events.txt": "step 3: [warning] alert: a\n"}
    sink.text(5, "gradscope/events", ["[critical] alert: b"])
    assert readback.mlflow_texts(tmp_path)["gradscope/events.txt"].splitlines() == [
        "step 3: [warning] alert: a", "step 5: [critical] alert: b"]
    sink.close()


def test_export_errors_are_one_line(tmp_path, capsys):
    assert main(["export", str(tmp_path / "missing.h5"), "--to", "tensorboard", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith("gradscope: error: ")
    with pytest.raises(SystemExit) as exit_:
        main(["export", "x.h5", "--to", "neptune", str(tmp_path)])
    assert exit_.value.code == 2
    assert "invalid choice: 'neptune'" in capsys.readouterr().err


def test_export_to_an_unwritable_place(ip_run, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["export", str(ip_run), "--to", "tensorboard", str(blocker / "tb")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gradscope: error: cannot write tensorboard output") and err.count("\n") == 1


def test_a_missing_library_names_its_extra(tmp_path, monkeypatch):
    for name in [m for m in sys.modules if m == "mlflow" or m.startswith("mlflow.")] + ["mlflow"]:
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
    monkeypatch.delitem(sys.modules, "gradscope.integrations.mlflow", raising=False)
    with pytest.raises(ConfigError, match=r"pip install 'gradscope\[mlflow\]'"):
        open_sink("mlflow", tmp_path, run_name="r", config={})
    # gradscope train --log-to: refused before any model or run file exists
    out = tmp_path / "run.h5"
    assert main(["train", "--steps", "1", "--log-to", "mlflow", "--out", str(out)]) == 2
    assert not out.exists() and not (tmp_path / "run.h5.logs").exists()


def test_an_unusable_mlflow_store_is_one_line(ip_run, tmp_path, capsys, monkeypatch):
    # an unreachable tracking server: MLflow's own retries (none here, to keep the test short), then one line
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    assert main(["export", str(ip_run), "--to", "mlflow", "http://127.0.0.1:9"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gradscope: error: mlflow store http://127.0.0.1:9 cannot be used: ") and err.count("\n") == 1

    def export(dest, blocked=()):
        """``gradscope export`` in a fresh process where importing ``blocked`` fails (as if not installed)."""
        code = (f"import sys; sys.modules.update(dict.fromkeys({list(blocked)!r})); from gradscope.cli import main; "
                f"sys.exit(main(['export', {str(ip_run)!r}, '--to', 'mlflow', {str(dest)!r}]))")
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    # mlflow-skinny without SQLAlchemy (MLflow then registers no SQL scheme): the message names the extra
    out = export(tmp_path / "store", blocked=["sqlalchemy"])
    assert out.returncode == 2 and out.stderr == (f"gradscope: error: mlflow store sqlite:///{tmp_path}/store/mlflow.db "
                                                  "needs the sqlalchemy package: pip install 'gradscope[mlflow]'\n")
    # a new store: its one line on stdout, none of MLflow's "Creating initial MLflow database tables" on stderr
    out = export(tmp_path / "fresh")
    assert out.returncode == 0 and out.stderr == "" and out.stdout.startswith("exported ") and out.stdout.count("\n") == 1


def test_names_are_safe_for_every_dashboard():
    assert scalar_name("cos/a|b/c") == "gradscope/cos/a_b/c"
    assert scalar_name("norm/voter 1.x-y") == "gradscope/norm/voter 1.x-y"


@pytest.mark.slow
def test_train_log_to_every_dashboard(tmp_path, alternating_rewards):
    """``gradscope train --log-to``: the dashboards hold the run file's own step statistics and alerts."""
    from gradscope.integrations.scalars import step_scalars
    from gradscope.trainers.config import TrainConfig
    from gradscope.trainers.train import Trainer

    out = tmp_path / "run.h5"
    cfg = TrainConfig(steps=3, tasks_per_step=2, n_held_out=8, eval_every=2, out=str(out),
                      log_to="tensorboard,wandb,mlflow", alert=["grad_norm[*] > 0: warn"], default_alerts=False)
    Trainer(cfg, echo=lambda line: None).run()
    with open_run(out) as r:
        steps, cols = step_scalars(r.gram, r.tokens, r.step, r.meta.agents, r.meta.agent_roles)
        metrics, n_alerts = r.metrics_wide(), int((r.events["kind"] == "alert").sum())
    logs = tmp_path / "run.h5.logs"
    assert n_alerts >= 2
    for values in (readback.tensorboard_scalars(logs / "tensorboard"), readback.wandb_history(logs / "wandb"),
                   readback.mlflow_metrics(logs / "mlflow")):
        for t, step in enumerate(steps):
            for name in ("gradscope/grad_norm", "gradscope/norm/voter", "gradscope/norm/aggregator",
                         "gradscope/coherence/voter", "gradscope/cos/voter0/voter1"):
                assert values[name][int(step)] == pytest.approx(cols[name][t], rel=1e-5), (name, step)
            assert values["gradscope/train/accuracy"][int(step)] == pytest.approx(metrics.loc[step, "train/accuracy"])
        assert set(values["gradscope/eval/accuracy"]) == {0, 2, 3}
    events = readback.tensorboard_texts(logs / "tensorboard")["gradscope/events"][1]
    assert "grad_norm[voter]" in events and "grad_norm[aggregator]" in events
    events = readback.wandb_history(logs / "wandb")["gradscope/events"][1]
    assert "grad_norm[voter]" in events and "grad_norm[aggregator]" in events


def recording_writer(run_writer=None):
    """A SinkWriter over ``run_writer`` (default: no run file) into one sink that records what it is sent:
    (writer, sink)."""
    from gradscope.integrations.sinks import Sink, SinkWriter

    class Recording(Sink):
        def __init__(self):
            self.scalars_sent, self.texts = [], []

        def scalars(self, step, values):
            self.scalars_sent.append((step, dict(values)))

        def text(self, step, tag, lines):
            self.texts.append((step, tag, list(lines)))

        def close(self):
            pass

    class Null:
        def __getattr__(self, name):
            return lambda *a, **k: None

    sink = Recording()
    return SinkWriter(Null() if run_writer is None else run_writer, [sink], ["voter0", "aggregator"],
                      ["voter", "aggregator"]), sink


def test_a_resumed_run_tells_the_dashboards_it_was_resumed(ip_run, tmp_path):
    """train --resume --log-to: the file's "resume" event reached only the file (the resume writes it before
    any dashboard is attached); `gradscope export` showed it. Now the dashboards get it too, at its step."""
    import shutil

    path = tmp_path / "ip.h5"
    shutil.copy(ip_run, path)
    writer, sink = recording_writer(RunWriter.resume(path, keep_below_step=6))
    writer.close()
    with open_run(path) as run:
        (row,) = [e for e in run.events.itertuples() if e.kind == "resume"][-1:]
    assert sink.texts == [(6, "gradscope/events", [f"[info] resume: {row.message}"])]


def test_an_event_between_a_steps_records_does_not_split_the_step():
    """IP logs one record per policy; a probe warning logged between them: the step is still sent once,
    its statistics the mean over both records (the documented rule)."""
    writer, sink = recording_writer()
    writer.log_step(1, np.diag([1.0, 0.0]), [3, 0])
    writer.log_event(1, "probe", "hooks fell back to split for a call", severity="warning")
    writer.log_step(1, np.diag([0.0, 4.0]), [0, 2])
    writer.log_metrics(1, {"train/accuracy": 0.5})
    writer.close()
    stats = [v for step, v in sink.scalars_sent if "gradscope/grad_norm" in v]
    assert len(stats) == 1 and stats[0]["gradscope/grad_norm"] == pytest.approx((1.0 + 2.0) / 2)
    assert sink.texts == [(1, "gradscope/events", ["[warning] probe: hooks fell back to split for a call"])]


TINY_TRAIN = ["train", "--steps", "1", "--tasks-per-step", "1", "--group-size", "2", "--n-held-out", "1",
              "--max-new-tokens", "8", "--no-default-alerts"]


def _one_line_error(capsys) -> str:
    """The error line on standard error (after any progress bar), checked to be the only one and no traceback."""
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.endswith("\n") and err.count("gradscope: error: ") == 1, err
    last = err.splitlines()[-1]
    assert last.startswith("gradscope: error: "), err
    return last


def test_train_log_to_problems_are_refused_before_anything_is_made(tmp_path, capsys, monkeypatch):
    """A --log-dir that cannot be a folder, or mlflow without SQLAlchemy: exit 2 before any model or run file."""
    out, blocker = tmp_path / "run.h5", tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setattr("gradscope.trainers.train.load_base", lambda *a, **k: pytest.fail("model built"))
    for args in (["--log-to", "tensorboard", "--log-dir", str(blocker)],
                 ["--log-to", "wandb", "--log-dir", str(blocker / "sub")]):
        assert main([*TINY_TRAIN, "--out", str(out), *args]) == 2
        assert f"{blocker} is not a folder" in _one_line_error(capsys)
    monkeypatch.setitem(sys.modules, "sqlalchemy", None)  # mlflow-skinny without SQLAlchemy
    assert main([*TINY_TRAIN, "--out", str(out), "--log-to", "mlflow"]) == 2
    assert "needs the sqlalchemy package: pip install 'gradscope[mlflow]'" in _one_line_error(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_a_sink_failing_to_open_makes_no_run_file(tmp_path, capsys, monkeypatch):
    from gradscope.integrations.tensorboard import TensorBoardSink

    def refuse(self, logdir):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(TensorBoardSink, "__init__", refuse)
    out = tmp_path / "run.h5"
    assert main([*TINY_TRAIN, "--out", str(out), "--log-to", "tensorboard"]) == 2
    assert "cannot write tensorboard output to " in _one_line_error(capsys) and not out.exists()


def test_a_sink_failing_while_training_is_one_line_and_the_run_file_stays_readable(tmp_path, capsys, monkeypatch):
    from gradscope.integrations.tensorboard import TensorBoardSink

    def disk_full(self, step, values):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(TensorBoardSink, "scalars", disk_full)
    out = tmp_path / "run.h5"
    assert main([*TINY_TRAIN, "--out", str(out), "--log-to", "tensorboard"]) == 2
    assert "--log-to tensorboard failed at step 0: OSError: " in _one_line_error(capsys)
    with open_run(out) as run:  # what was logged before the failure: the base evaluation
        assert set(run.evals["step"].tolist()) == {0}


def test_names_that_become_one_are_an_error_not_a_lost_value(tmp_path, capsys):
    """Agents a:1 and a_1 would both be gradscope/agent_norm/a_1 (one value lost): refused, naming both."""
    run = tmp_path / "run.h5"
    meta = RunMeta(agents=["a:1", "a_1"], agent_roles=["r", "r"], roles=["r"])
    with RunWriter(run, meta) as w:
        w.log_step(1, np.eye(2), [3, 4])
    assert main(["export", str(run), "--to", "tensorboard", str(tmp_path / "tb")]) == 2
    assert capsys.readouterr().err == ("gradscope: error: 'agent_norm/a:1' and 'agent_norm/a_1' both become the "
                                       "dashboard name 'gradscope/agent_norm/a_1' (characters other than letters, "
                                       "digits and _ . / - space become _): rename one\n")
    assert not (tmp_path / "tb").exists()
    with RunWriter(tmp_path / "metrics.h5", RunMeta(agents=["a"], agent_roles=["r"], roles=["r"])) as w:
        w.log_step(1, np.eye(1), [3])
        w.log_metrics(1, {"acc:x": 1.0, "acc_x": 2.0})
    assert main(["export", str(tmp_path / "metrics.h5"), "--to", "tensorboard", str(tmp_path / "tb")]) == 2
    assert "'acc:x' and 'acc_x' both become the dashboard name 'gradscope/acc_x'" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["a//b", "a/", "a/../b"])
def test_a_name_mlflow_refuses_is_one_line(tmp_path, capsys, name):
    run = tmp_path / "run.h5"
    with RunWriter(run, RunMeta(agents=["a"], agent_roles=["r"], roles=["r"])) as w:
        w.log_step(1, np.eye(1), [3])
        w.log_metrics(1, {name: 1.0})
    assert main(["export", str(run), "--to", "mlflow", str(tmp_path / "store")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gradscope: error: mlflow refused the values of step 1: ") and err.count("\n") == 1, err


def test_log_to_renames_a_metric_named_like_a_statistic_as_export_does():
    """--log-to and export give a run's values the same names: TRL-style grad_norm as gradscope/metric/grad_norm."""
    writer, sink = recording_writer()
    writer.log_metrics(1, {"grad_norm": 123.0, "train/accuracy": 0.5})  # before any record: still renamed
    writer.log_step(2, np.diag([1.0, 4.0]), [3, 2])
    writer.log_metrics(2, {"norm/voter": 7.0})
    writer.close()
    sent = {name: value for _, values in sink.scalars_sent for name, value in values.items()}
    assert sent["gradscope/metric/grad_norm"] == 123.0 and sent["gradscope/metric/norm/voter"] == 7.0
    assert sent["gradscope/grad_norm"] == pytest.approx(np.sqrt(5.0)) and sent["gradscope/norm/voter"] == 1.0


def test_a_file_store_needs_mlflows_opt_in(ip_run, tmp_path, capsys, monkeypatch):
    """MLflow 3 opens a file: store only with MLFLOW_ALLOW_FILE_STORE=true: the one line says so."""
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    dest = f"file:{tmp_path}/mlruns"
    assert main(["export", str(ip_run), "--to", "mlflow", dest]) == 2
    assert capsys.readouterr().err == (f"gradscope: error: mlflow store {dest} cannot be used: MLflow opens a file: "
                                       f"store only with MLFLOW_ALLOW_FILE_STORE=true set; or give a folder "
                                       f"(a SQLite store)\n")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    assert main(["export", str(ip_run), "--to", "mlflow", dest]) == 0


def test_a_long_mlflow_message_is_cut_at_a_word():
    from mlflow.exceptions import MlflowException

    from gradscope.integrations.mlflow import _message

    text = "word " * 100 + "\nsecond line"
    short = _message(MlflowException(text))
    assert len(short) <= 300 and short.endswith("word ...") and "second" not in short


def test_two_values_of_one_dashboard_name_are_an_error_whatever_makes_them_one():
    """Agents "x/y", "z", "x", "y/z" gave the pairs (x/y, z) and (x, y/z) the one name cos/x/y/z, and a metric
    "eval/acc" and an evaluation "acc" the one name gradscope/eval/acc: one value of each silently lost."""
    from gradscope.errors import ConfigError
    from gradscope.integrations.scalars import DashboardNames, step_scalars
    with pytest.raises(ConfigError, match=r"the pairs \('x/y', 'z'\) and \('x', 'y/z'\) both become .*'cos/x/y/z'"):
        step_scalars(np.eye(4)[None], np.ones((1, 4)), [1], ["x/y", "z", "x", "y/z"], ["r"] * 4)
    names = DashboardNames(["a"], ["r"])
    assert names.metric("eval/acc") == names.metric("eval/acc") == "gradscope/eval/acc"
    with pytest.raises(ConfigError, match="'eval/acc' and evaluation 'acc' both become the dashboard name"):
        names.metric("acc", prefix="eval/")
