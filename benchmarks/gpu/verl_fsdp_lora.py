"""The verl hook's full path on GPUs: FSDP2, bf16, a Qwen3-0.6B-shaped model with LoRA r64.

What it checks and measures (docs/integrations.md, "verl"), with verl's own ``FSDPEngineWithLMHead``:

1. the hooked step's Gram against brute force (one unprobed ``forward_backward_batch`` per agent on
   the batch whose other agents' advantages are 0; one process), and √ΣM against verl's grad_norm;
2. N GPUs (each 1/N of the global batch) against one GPU on the same batch (Gram, tokens);
3. the step time, plain and probed, side by side (plain, probed, plain; medians; their ratio).

Run on a machine with CUDA GPUs, from the repository root, in an environment with ``gradscope[verl]``::

    python benchmarks/gpu/verl_fsdp_lora.py --out /tmp/verl_gpu          # 1 GPU, then all GPUs (<= 8)

``--tiny`` is the CPU dry run (a 2-layer model, gloo, the CPU platform of tests/integrations/test_verl.py).
The model is random-initialised from a config (no download): same shapes and cost as Qwen3-0.6B.
Not run on a GPU yet.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
AGENTS = ["voter0", "voter1", "voter2", "aggregator"]
ROLES = {"voter0": "voter", "voter1": "voter", "voter2": "voter", "aggregator": "aggregator"}
QWEN3_0_6B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                  max_position_embeddings=4096)
TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, vocab_size=512, tie_word_embeddings=False, max_position_embeddings=256)


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="folder for the model, run files and results")
    ap.add_argument("--tiny", action="store_true", help="CPU dry run: tiny model, gloo")
    ap.add_argument("--gpus", type=int, default=0, help="processes of the N-GPU run (default: all, at most 8)")
    ap.add_argument("--rows", type=int, default=32, help="global batch rows (a multiple of 4 agents x GPUs)")
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens per row")
    ap.add_argument("--response", type=int, default=512, help="response tokens per row")
    ap.add_argument("--micro", type=int, default=4, help="micro-batch rows per GPU")
    ap.add_argument("--lora-rank", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="timed steps per arm")
    ap.add_argument("--attn", default="sdpa", help="attn_implementation (sdpa, flash_attention_2, eager)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.tiny:
        args.rows, args.prompt, args.response, args.micro, args.lora_rank = 8, 6, 8, 2, 4
        args.attn, args.repeats = "eager", 2
    return args


# ---------------------------------------------------------------------- one torchrun process
def child(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    sys.path.append(str(ROOT))  # after the installed gradscope: the checkout's gradscope/ would shadow it
    from tests.integrations.test_verl import cpu_platform, flat_grad  # the tests' helpers

    if args.tiny:
        cpu_platform()
        dist.init_process_group("gloo")
    else:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = Path(args.out)
    if rank == 0 and not (out / "model" / "config.json").exists():
        save_model(out / "model", TINY if args.tiny else QWEN3_0_6B)
    dist.barrier()

    from verl.trainer.config import CheckpointConfig
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import FSDPActorConfig, FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
    from verl.workers.utils.losses import ppo_loss

    from gradscope.integrations.verl import VerlProbe, VerlSettings

    model = HFModelConfig(path=str(out / "model"), lora_rank=args.lora_rank, lora_alpha=args.lora_rank // 2,
                          target_modules="all-linear", use_remove_padding=False, enable_gradient_checkpointing=True,
                          override_config={"attn_implementation": args.attn})
    precision = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"} if args.tiny else None
    engine = FSDPEngineWithLMHead(  # mixed_precision None: verl's default, bf16 params, fp32 reduction
        model_config=model, checkpoint_config=CheckpointConfig(),
        engine_config=FSDPEngineConfig(strategy="fsdp2", use_torch_compile=False, micro_batch_size_per_gpu=args.micro,
                                       mixed_precision=precision),
        optimizer_config=FSDPOptimizerConfig(lr=1e-5, total_training_steps=100))
    torch.manual_seed(0)
    engine.initialize()
    loss = partial(ppo_loss, config=FSDPActorConfig(strategy="fsdp2", rollout_n=1, use_torch_compile=False,
                                                    ppo_micro_batch_size_per_gpu=args.micro))
    mine = slice(rank * args.rows // world, (rank + 1) * args.rows // world)

    def batch(seed: int, only=None):
        td = voting_batch(args, seed, mine, only)
        tu.assign_non_tensor(td, calculate_entropy=False, global_batch_size=args.rows, temperature=1.0,
                             use_remove_padding=False, use_dynamic_bsz=False, micro_batch_size_per_gpu=args.micro,
                             use_fused_kernels=False)
        return td

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    saved: dict[str, np.ndarray] = {}
    with engine.train_mode():
        if world == 1:  # brute force on the initial weights
            brute = []
            for agent in AGENTS:
                engine.optimizer_zero_grad()
                engine.forward_backward_batch(batch(1, agent), loss)
                brute.append(flat_grad(engine.module))
            G = torch.stack(brute)
            saved["brute_gram"] = (G @ G.T).cpu().numpy()
            engine.optimizer_zero_grad()

        def timed(probe: VerlProbe | None, seed: int) -> float:
            sync()
            t0 = time.perf_counter()
            if probe is None:
                engine.train_batch(batch(seed), loss)
            else:
                with probe.training_step():
                    engine.train_batch(batch(seed), loss)
            sync()
            return time.perf_counter() - t0

        probe = VerlProbe(engine, VerlSettings(run=str(out / f"run{world}.h5"), overwrite=True, roles=ROLES))
        timed(probe, 1)  # the measured step: initial weights, same batch as the brute force
        result, scalars = probe.records[0]
        saved.update(gram=result.gram, tokens=result.tokens, grad_norm=np.array(scalars["grad_norm"]),
                     measurement=np.array(probe.probe.measurement))
        times = {"plain": [], "probed": []}
        for arm in ("plain", "probed", "plain"):
            if arm == "plain":
                probe.close()
            else:
                probe = VerlProbe(engine, VerlSettings(run=str(out / f"timing{world}.h5"), overwrite=True, roles=ROLES))
            timed(probe if arm == "probed" else None, 2)  # warm-up
            times[arm] += [timed(probe if arm == "probed" else None, 3 + i) for i in range(args.repeats)]
        if torch.cuda.is_available():
            saved["peak_gib"] = np.array(torch.cuda.max_memory_allocated() / 2**30)
    saved["plain_s"], saved["probed_s"] = np.array(times["plain"]), np.array(times["probed"])
    np.savez(out / f"gpu{world}_rank{rank}.npz", **saved)
    dist.destroy_process_group()


def save_model(path: Path, shape: dict) -> None:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    from gradscope.trainers.testbed.tokenizer import build_tokenizer

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(Qwen3Config(**shape)).save_pretrained(path)
    build_tokenizer().save_pretrained(path)  # any tokenizer: the batch is random token ids


def voting_batch(args: argparse.Namespace, seed: int, rows: slice, only: str | None):
    """Random Voting-shaped rows (voter0..2, aggregator in turn), verl's no-padding layout; ``only``:
    zero the advantages of every other agent (brute force)."""
    import torch
    from tensordict import TensorDict
    from tensordict.tensorclass import NonTensorData, NonTensorStack
    from verl.workers.utils.padding import left_right_2_no_padding

    g = torch.Generator().manual_seed(seed)
    n, P, R = args.rows, args.prompt, args.response
    vocab = (TINY if args.tiny else QWEN3_0_6B)["vocab_size"]
    prompts, responses = torch.randint(3, vocab, (n, P), generator=g), torch.randint(3, vocab, (n, R), generator=g)
    pmask = (torch.arange(P)[None] >= torch.randint(0, P // 2, (n, 1), generator=g)).long()   # left padding
    rmask = (torch.arange(R)[None] < torch.randint(R // 4, R + 1, (n, 1), generator=g)).long()  # right padding
    attention = torch.cat([pmask, rmask], 1)
    agents = [AGENTS[i % 4] for i in range(n)]
    adv = torch.randn(n, 1, generator=g).expand(n, R).clone()  # GRPO: one advantage per trajectory
    if only is not None:
        adv *= torch.tensor([a == only for a in agents])[:, None]
    td = TensorDict({"prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
                     "attention_mask": attention, "position_ids": (attention.cumsum(1) - 1).clamp(min=0),
                     "response_mask": rmask, "old_log_probs": -3 * torch.rand(n, R, generator=g),
                     "advantages": adv}, batch_size=[n])
    td["agent_name"] = NonTensorStack.from_list([NonTensorData(a) for a in agents])
    return left_right_2_no_padding(td[rows])


# ---------------------------------------------------------------------- the driver
def launch(args: argparse.Namespace, nproc: int) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={port}",
           __file__, "--child", *sys.argv[1:]]
    subprocess.run(cmd, cwd=ROOT, env=env, check=True)


def main(argv=None) -> int:
    args = parse(argv)
    if args.child:
        child(args)
        return 0
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.tiny:
        n = 2
    else:
        import torch

        if not torch.cuda.is_available():
            print("verl_fsdp_lora: no CUDA device (use --tiny for the CPU dry run)", file=sys.stderr)
            return 2
        n = args.gpus or min(torch.cuda.device_count(), 8)
    launch(args, 1)
    if n > 1:
        launch(args, n)
    one = dict(np.load(Path(args.out) / "gpu1_rank0.npz"))
    M, B = one["gram"], one["brute_gram"]
    report = {"shape": "tiny" if args.tiny else "qwen3-0.6b", "lora_rank": args.lora_rank,
              "rows": args.rows, "tokens_per_row": args.prompt + args.response,
              "gram_vs_brute_rel": float(np.abs(M - B).max() / np.abs(B).max()),
              "sqrt_sum_M_over_grad_norm": float(np.sqrt(M.sum()) / one["grad_norm"]),
              "step_s_plain_1": statistics.median(one["plain_s"]), "step_s_probed_1": statistics.median(one["probed_s"])}
    report["probed_over_plain_1"] = report["step_s_probed_1"] / report["step_s_plain_1"]
    if n > 1:
        many = dict(np.load(Path(args.out) / f"gpu{n}_rank0.npz"))
        report.update({f"gram_{n}_vs_1_rel": float(np.abs(many["gram"] - M).max() / np.abs(M).max()),
                       f"tokens_{n}_equal": bool((many["tokens"] == one["tokens"]).all()),
                       f"probed_over_plain_{n}": statistics.median(many["probed_s"]) / statistics.median(many["plain_s"]),
                       f"measurement_{n}": str(many["measurement"])})
    if "peak_gib" in one:
        report["peak_gib_1"] = float(one["peak_gib"])
    print(json.dumps(report, indent=1))
    (Path(args.out) / "report.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
