"""Per-step cost of the probe under data parallelism: all-reduce volume (exact vs sketch) and sketch time.

1. **Communication**, computed from parameter shapes: a Qwen3-0.6B-sized model (hidden 1024, 28
   layers, intermediate 3072, 16 query / 8 KV heads of 128, vocab 151936, tied embeddings; built on
   PyTorch's meta device from ``Qwen3Config``, nothing downloaded). Per probed step every rank
   all-reduces (sum) its store: exact, the K per-agent gradients in fp32 (K × P × 4 bytes); sketched,
   k float64 buckets per cell (group × LoRA adapter) and agent (cells × K × k × 8 bytes); plus K token
   counts (int64). Beside it, the gradient all-reduce that data-parallel training does anyway (P ×
   2 bytes in bf16). Bytes are the all-reduce payload; a ring all-reduce sends about twice that per
   rank. Full fine-tune (every parameter) and LoRA r=64 on every linear map of the decoder layers.
2. **Time**, measured side by side in one process (as ``bench_probe.py``: one model copy per variant,
   interleaved, medians, one torch thread): forward + loss + backward + Gram on the testbed model
   (2 layers, hidden 128), exact vs sketched (k=256), for LoRA r8 and for full fine-tuning of every
   decoder linear weight (embeddings and norms frozen, so both methods apply), K = 4 and 8; ratios to
   the plain step.

Run: ``.venv/bin/python benchmarks/comm_volume.py [--threads N]``.
"""
from __future__ import annotations

import copy
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_probe import CONFIGS, lora_model, make_batch, token_loss
from transformers import AutoModelForCausalLM, Qwen3Config

from gradscope.probe import Probe, Sketch
from gradscope.probe.groups import by_layer
from gradscope.trainers.testbed.model import build_testbed_model

QWEN3_06B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True)
LORA_RANK = 64
AGENTS = (4, 8)
SKETCH_K = (256, 1024)
GiB, MiB, KiB = 2 ** 30, 2 ** 20, 2 ** 10


def qwen3_shapes() -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every parameter of a Qwen3-0.6B-sized model, tied weights once."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(Qwen3Config(**QWEN3_06B))
    return [(n, tuple(p.shape)) for n, p in model.named_parameters()]


def lora_shapes(shapes: list[tuple[str, tuple[int, ...]]], rank: int) -> list[tuple[str, tuple[int, ...]]]:
    """LoRA A (r, d_in) and B (d_out, r) for every linear weight of the decoder layers ("all-linear")."""
    out = []
    for name, shape in shapes:
        if ".layers." in name and name.endswith("proj.weight"):
            d_out, d_in = shape
            out += [(name + ".lora_A", (rank, d_in)), (name + ".lora_B", (d_out, rank))]
    return out


def volume(shapes: list[tuple[str, tuple[int, ...]]], K: int, k: int | None, groups: str) -> int:
    """All-reduce payload (bytes) of one probed step: the store plus K token counts."""
    P = sum(int(torch.Size(s).numel()) for _, s in shapes)
    cells = len({by_layer(n) for n, _ in shapes}) if groups == "layer" else 1
    return (K * P * 4 if k is None else cells * K * k * 8) + K * 8


def _fmt(n: float) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def comm_table(verbose: bool = True) -> list[dict[str, Any]]:
    full = qwen3_shapes()
    models = {"full fine-tune": full, f"LoRA r{LORA_RANK} (one adapter)": lora_shapes(full, LORA_RANK)}
    rows = []
    for label, shapes in models.items():
        P = sum(int(torch.Size(s).numel()) for _, s in shapes)
        if verbose:
            print(f"{label}: {P / 1e6:.1f}M probed values; the gradient all-reduce itself: {_fmt(P * 2)} (bf16)")
        for K in AGENTS:
            for groups in ("all", "layer"):
                exact = volume(shapes, K, None, groups)
                sk = {k: volume(shapes, K, k, groups) for k in SKETCH_K}
                rows.append(dict(model=label, P=P, K=K, groups=groups, exact=exact, sketch=sk))
                if verbose:
                    sketched = ", ".join(f"k={k}: {_fmt(v)} ({exact / v:,.0f}x less)" for k, v in sk.items())
                    print(f"  K={K} groups={groups:<5}  exact {_fmt(exact):>10}   sketch {sketched}")
    return rows


# ---------------------------------------------------------------- timing on the testbed
def full_ft_model(sizes: dict[str, int]) -> nn.Module:
    """The testbed with every decoder linear weight trainable, embeddings and norms frozen."""
    model = build_testbed_model(0, **sizes)
    for name, p in model.named_parameters():
        p.requires_grad_(".layers." in name and name.endswith("proj.weight"))
    return model.eval()


def time_variants(model: nn.Module, K: int, reps: int, warmup: int, B: int, T: int) -> dict[str, float]:
    """Median step time (s) of plain and each probe variant, interleaved, one model copy per variant."""
    variants = {"plain": None, "hooks": ("hooks", None), "hooks+sketch": ("hooks", Sketch(256)),
                "split": ("split", None), "split+sketch": ("split", Sketch(256))}
    batch = make_batch(model.config.vocab_size, B, T, K)
    agents = [f"a{k}" for k in range(K)]
    models = {v: copy.deepcopy(model) for v in variants}
    probes = {v: Probe(models[v], agents, {a: "r" for a in agents}, method=m, sketch=s,
                       params=[(n, p) for n, p in models[v].named_parameters() if p.requires_grad])
              for v, spec in variants.items() if spec is not None for m, s in [spec]}
    times: dict[str, list[float]] = {v: [] for v in variants}
    names = list(variants)
    for rep in range(warmup + reps):
        for v in names[rep % len(names):] + names[: rep % len(names)]:
            m = models[v]
            m.zero_grad(set_to_none=True)
            ids, agent_ids, adv = batch
            t0 = time.perf_counter()
            loss = token_loss(m, ids, agent_ids, adv)
            if v == "plain":
                loss.sum().backward()
            else:
                with probes[v].step(0) as s:
                    s.backward_tokens(loss, agent_ids)
            if rep >= warmup:
                times[v].append(time.perf_counter() - t0)
    for probe in probes.values():
        probe.close()
    return {v: statistics.median(ts) for v, ts in times.items()}


def timing_table(verbose: bool = True) -> list[dict[str, Any]]:
    sizes, rank, B, T, warmup, reps = CONFIGS["testbed"]
    rows = []
    for label, build in ((f"testbed LoRA r{rank}", lambda: lora_model(sizes, rank)),
                         ("testbed full FT (linear weights)", lambda: full_ft_model(sizes))):
        model = build()
        P = sum(p.numel() for p in model.parameters() if p.requires_grad)
        for K in AGENTS:
            med = time_variants(model, K, reps, warmup, B, T)
            ratio = {v: med[v] / med["plain"] for v in med}
            rows.append(dict(model=label, P=P, K=K, median_s=med, ratio=ratio))
            if verbose:
                cells = "  ".join(f"{v} {ratio[v]:.2f}x" for v in med if v != "plain")
                print(f"  {label} ({P / 1e3:.0f}k probed), K={K}: plain {med['plain'] * 1e3:.0f} ms; {cells}")
    return rows


def main(verbose: bool = True, threads: int = 1) -> dict[str, list[dict[str, Any]]]:
    if threads:
        torch.set_num_threads(threads)
    if verbose:
        print("All-reduce payload per probed step (Qwen3-0.6B-sized model):")
    comm = comm_table(verbose)
    if verbose:
        print(f"Step time with the probe, ratio to the plain step (torch {torch.__version__}, "
              f"{torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.2f}):")
    timing = timing_table(verbose)
    return {"comm": comm, "timing": timing}


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default); default 1")
    main(threads=parser.parse_args().threads)
