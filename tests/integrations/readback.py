"""Read what the sinks wrote, with each dashboard's own reader (W&B's offline log format by hand:
wandb 0.31 ships no Python reader for it)."""
from __future__ import annotations

import json
import sqlite3
import struct
from collections import defaultdict
from pathlib import Path

_BLOCK = 32768  # W&B's run file is a LevelDB-style log: 32 KiB blocks of (crc, length, type) records


def tensorboard_scalars(logdir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0}).Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def tensorboard_texts(logdir: Path) -> dict[str, dict[int, str]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"tensors": 0}).Reload()
    out: dict[str, dict[int, str]] = {}
    for tag in acc.Tags()["tensors"]:
        texts = out.setdefault(tag.removesuffix("/text_summary"), {})
        for e in acc.Tensors(tag):  # several texts at one step are joined
            texts[e.step] = "\n".join(filter(None, [texts.get(e.step), e.tensor_proto.string_val[0].decode()]))
    return out


def wandb_history(folder: Path) -> dict[str, dict[int, object]]:
    """key → {step: value} from the ``history`` records of the offline run in ``folder`` (``folder/offline-run-*``,
    where the docs say it is)."""
    from wandb.proto import wandb_internal_pb2

    (path,) = list(Path(folder).glob("offline-run-*/run-*.wandb"))
    data = path.read_bytes()
    assert data[:4] == b":W&B", "not a W&B run file"
    pos, pending, records = 7, b"", []
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:  # block trailer
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        payload, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 1:
            records.append(payload)
        elif kind == 2:
            pending = payload
        elif kind == 3:
            pending += payload
        elif kind == 4:
            records.append(pending + payload)
        elif kind == 0 and length == 0:
            pos += left - 7  # zero padding to the end of the block
    history: dict[str, dict[int, object]] = defaultdict(dict)
    for raw in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            step = int(items.get("_step", record.history.step.num))
            for key, value in items.items():
                history[key][step] = value
    return dict(history)


def mlflow_metrics(folder: Path) -> dict[str, dict[int, float]]:
    """key → {step: value} straight from the SQLite store's ``metrics`` table."""
    with sqlite3.connect(Path(folder) / "mlflow.db") as db:
        rows = db.execute("SELECT key, step, value FROM metrics").fetchall()
    out: dict[str, dict[int, float]] = defaultdict(dict)
    for key, step, value in rows:
        out[key][int(step)] = float(value)
    return dict(out)


def mlflow_texts(folder: Path) -> dict[str, str]:
    """artifact path (under the run's artifact folder) → text, for the ``.txt`` artifacts."""
    return {str(p.relative_to(next(Path(folder, "artifacts").glob("*/artifacts")))): p.read_text()
            for p in Path(folder, "artifacts").rglob("*.txt")}
