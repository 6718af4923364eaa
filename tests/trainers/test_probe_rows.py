"""The trainer tags its loss forward with each row's agent, so the probe's hooks find the batch
dimension even when a mini-batch's padded length T equals its number of samples B (the hooks cannot
tell the two apart by shape; a 30-step run at lr 1e-2 hit it)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from gradscope.trainers import grpo
from gradscope.trainers.train import Trainer
from tests.trainers.test_mitigations import batch_of, small


def test_gram_is_measured_when_the_padded_length_equals_the_batch(tmp_path, monkeypatch):
    trainer = Trainer(small(tmp_path))
    assert trainer.probe.method_name == "hooks"
    up = trainer.updater
    batch = batch_of(trainer)
    pack_width = grpo.pack([s.turn.sample for s in batch], up.pad_id, "cpu")[0].shape[1]
    batch = batch * -(-pack_width // len(batch))  # B >= T: repeat the samples, then pad T up to B
    width = len(batch)
    n_tokens = sum(len(s.turn.sample.completion_ids) for s in batch)

    def gram(step: int):
        for p in up.params["shared"]:
            p.grad = None
        with trainer.probe.step(step, policy="shared") as probed:
            token_loss, _ = up._token_loss("shared", batch, n_tokens, probed)
            probed.backward_tokens(*token_loss)
        return probed.result.gram

    gram(1)  # the hooks' self-check against split runs on the first probed step only...
    plain = gram(2)
    for layer in trainer.probe._method.layers:  # ...and verifies the layers it saw; under IP the other
        layer.batch_dim = None                  # adapters' layers are never seen by it (the failing run)
    real_pack = grpo.pack

    def pack_to_width(samples, pad_id, device):  # left padding: positions come from the mask, loss unchanged
        ids, attn, comp = real_pack(samples, pad_id, device)
        extra = width - ids.shape[1]
        return F.pad(ids, (extra, 0), value=pad_id), F.pad(attn, (extra, 0)), F.pad(comp, (extra, 0))

    monkeypatch.setattr(grpo, "pack", pack_to_width)
    assert grpo.pack([s.turn.sample for s in batch], up.pad_id, "cpu")[0].shape == (len(batch), len(batch))
    padded = gram(3)
    assert float(abs(plain).max()) > 0
    torch.testing.assert_close(torch.as_tensor(padded), torch.as_tensor(plain), rtol=1e-4, atol=1e-10)
