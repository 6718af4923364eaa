"""The probe's cost on a GPU: a Qwen3-0.6B-shaped LM with LoRA r64, bf16 and fp32, K = 4 and 8 agents.

Per dtype and K, each method on its own copy of the model, interleaved after warm-up, CUDA-synchronised
medians and, per method, the rise of ``torch.cuda.max_memory_allocated`` over a timed step (``peak``), over
its first step (``first peak``: hooks' self-check keeps the graph for one backward per agent) and the
memory the probe keeps between steps (``kept``: per-agent buffers and scratch, not in the rises):

* ``plain``  ``token_loss.sum().backward()``;
* ``hooks``  ``Probe(method="hooks")`` (one backward; the first step's self-check is in the warm-up);
* ``split``  ``Probe(method="split")`` (one backward per agent).

Goal: hooks <= 1.05x plain. The model is built from its config (random weights, no download): 28 layers,
hidden 1024, 16 query / 8 key-value heads of 128, intermediate 3072, vocabulary 151,936, LoRA r64
(alpha 128) on every linear layer; batch B rows × T tokens (default 16 × 512), the first third of each
row prompt (no agent), every row one agent's.

Run: ``python benchmarks/gpu/bench_probe_gpu.py`` on a CUDA machine, with gradscope installed (measured on an
H200: docs/probe.md, "On a GPU"). ``--tiny`` runs a 2-layer, hidden-64
model on whatever device there is (CPU here), to check that the script works end to end.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
import warnings

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from bench_probe import make_batch, token_loss
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, Qwen3Config

from gradscope.probe import Probe

SHAPES = {
    "0.6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, rank=64),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, rank=8),
}
METHODS = ("plain", "hooks", "split")
GOAL = 1.05


def build(shape: str, dtype: torch.dtype, device: torch.device):
    sizes = dict(SHAPES[shape])
    rank = sizes.pop("rank")
    config = Qwen3Config(**sizes, max_position_embeddings=4096, tie_word_embeddings=True)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device)
    lora = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", lora_dropout=0.0,
                      init_lora_weights=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return get_peft_model(base, lora, adapter_name="policy").eval()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench(shape: str, dtype: torch.dtype, K: int, B: int, T: int, warmup: int, reps: int,
          device: torch.device) -> dict:
    model = build(shape, dtype, device)
    ids, agent_ids, adv = (t.to(device) for t in make_batch(model.config.vocab_size, B, T, K))
    models = {m: copy.deepcopy(model) for m in METHODS}
    del model
    agents = [f"a{k}" for k in range(K)]
    probes = {m: Probe(models[m], agents, {a: "r" for a in agents}, method=m,
                       params=[(n, p) for n, p in models[m].named_parameters() if p.requires_grad])
              for m in ("hooks", "split")}
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    peak: dict[str, float] = {m: 0.0 for m in METHODS}
    first_peak: dict[str, float] = {}
    grams = {}
    for rep in range(warmup + reps):
        order = METHODS[rep % len(METHODS):] + METHODS[:rep % len(METHODS)]
        for m in order:
            mdl = models[m]
            mdl.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
            sync(device)
            t0 = time.perf_counter()
            loss = token_loss(mdl, ids, agent_ids, adv)
            if m == "plain":
                loss.sum().backward()
            else:
                with probes[m].step(rep) as s:
                    s.backward_tokens(loss, agent_ids)
                grams[m] = s.result.gram
            sync(device)
            rise = (torch.cuda.max_memory_allocated(device) - base) / 2**20 if device.type == "cuda" else 0.0
            if rep == 0:
                first_peak[m] = rise
            if rep >= warmup:
                times[m].append(time.perf_counter() - t0)
                peak[m] = max(peak[m], rise)
    kept = {m: kept_mib(probes[m]) if m in probes else 0.0 for m in METHODS}
    for probe in probes.values():
        probe.close()
    med = {m: statistics.median(t) for m, t in times.items()}
    err = float(np.abs(grams["hooks"] - grams["split"]).max() / np.abs(grams["split"]).max())
    return {"median_s": med, "ratio": {m: med[m] / med["plain"] for m in med}, "peak_mib": peak,
            "first_peak_mib": first_peak, "kept_mib": kept, "hooks_vs_split": err}


def kept_mib(probe: Probe) -> float:
    """MiB of the tensors the probe's method holds between steps (in its attributes' dicts, lists and tuples;
    the model's parameters excluded), each storage once."""
    storages: dict[int, int] = {}
    todo = list(vars(probe._method).values())
    while todo:
        value = todo.pop()
        if isinstance(value, dict):
            todo.extend(value.values())
        elif isinstance(value, (list, tuple)):
            todo.extend(value)
        elif isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
            storage = value.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values()) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny model on any device (a dry run of the script)")
    parser.add_argument("--rows", type=int, default=16, help="batch rows B (default 16)")
    parser.add_argument("--tokens", type=int, default=512, help="tokens per row T (default 512)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    if args.tiny:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        shape, B, T, warmup, reps = "tiny", 4, 16, 1, 2
    else:
        if not torch.cuda.is_available():
            sys.exit("gradscope: error: no CUDA device; run with --tiny for a CPU dry run")
        device, shape, B, T, warmup, reps = torch.device("cuda"), "0.6b", args.rows, args.tokens, args.warmup, args.reps
    print(f"torch {torch.__version__}, device {device}" +
          (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "") + f", model {shape}, B={B}, T={T}")
    verdicts = []
    for dtype in (torch.bfloat16, torch.float32):
        for K in (4, 8):
            r = bench(shape, dtype, K, B, T, warmup, reps, device)
            print(f"{str(dtype).removeprefix('torch.')}, K={K}: Gram hooks vs split {r['hooks_vs_split']:.1e}")
            print(f"  {'method':<8}{'ms':>10}{'x plain':>9}{'peak MiB':>10}{'first peak':>12}{'kept MiB':>10}")
            for m in METHODS:
                print(f"  {m:<8}{r['median_s'][m] * 1e3:10.1f}{r['ratio'][m]:9.2f}{r['peak_mib'][m]:10.0f}"
                      f"{r['first_peak_mib'][m]:12.0f}{r['kept_mib'][m]:10.1f}")
            verdicts.append(f"{str(dtype).removeprefix('torch.')} K={K}: hooks {r['ratio']['hooks']:.3f}x "
                            f"{'meets' if r['ratio']['hooks'] <= GOAL else 'MISSES'} <= {GOAL}")
    print("goal: " + "; ".join(verdicts))


if __name__ == "__main__":
    main()
