"""The testbed warm start on disk: built once per config, reproducibly, then loaded.

**Reproducible on a machine, pinned for the record.** The build runs in a fresh interpreter
(:func:`main`) whose float kernels are fixed by :data:`BUILD_ENV`: one thread, ATen's AVX2 kernels,
MKL's conditional numerical reproducibility in AVX2 strict mode, oneDNN capped at AVX2. Measured on an
AVX-512 machine: ATen's AVX-512 kernels, MKL's default dispatch, or a second thread each change the
weights after a few dozen steps (and training amplifies that into different accuracies); with
:data:`BUILD_ENV` the weights do not depend on the thread count or the caller's settings. They still
depend on the CPU: another x86-64 machine of this workplace built other bytes with the same code (its
library kernels take other paths than these settings reach). :func:`weights_digest` (sha256 of the
fp32 weights) of the build behind the documented numbers is pinned in ``pinned.json``; every run file
records its own (:func:`provenance`), and ``python -m gradscope.trainers.testbed.cache verify`` says
whether this machine builds the pinned bytes. Nothing in the test suite depends on which bytes it got.

**Cached** under ``$GRADSCOPE_CACHE/testbed`` (default ``~/.cache/gradscope``), keyed by the config and
the source of every module the build depends on, so the weights stay in step with the code. A file
lock makes concurrent first runs wait for one build instead of each building it.
"""
from __future__ import annotations

import argparse
import dataclasses
import fcntl
import functools
import hashlib
import inspect
import json
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from collections.abc import Iterator
from pathlib import Path

import torch

from gradscope.trainers.testbed.model import build_testbed_model
from gradscope.trainers.testbed.scales import SCALES
from gradscope.trainers.testbed.warmstart import WarmStartConfig, train_warm_start

#: The build process's environment (on top of the caller's): the same float kernels on every x86-64
#: CPU with AVX2, whatever the host's core count.
BUILD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "ATEN_CPU_CAPABILITY": "avx2",
             "MKL_CBWR": "AVX2,STRICT", "ONEDNN_MAX_CPU_ISA": "AVX2"}
#: Build time of the default config (700 steps, 0.3M parameters) on one idle core, for the message a
#: first run prints (scaled by the step count only: the larger scales' steps cost more, 1.5M's about 5x;
#: the progress bar's ETA is the better guide there).
EXPECTED_SECONDS = 100
PINNED = Path(__file__).with_name("pinned.json")


def cache_dir() -> Path:
    return Path(os.environ.get("GRADSCOPE_CACHE", Path.home() / ".cache" / "gradscope"))


def config_id(cfg: WarmStartConfig) -> str:
    """A short name for a config's values (not the code): the key of its pinned digest."""
    return hashlib.sha256(repr(sorted(dataclasses.asdict(cfg).items())).encode()).hexdigest()[:12]


def cache_key(cfg: WarmStartConfig) -> str:
    """Changes whenever the config or the code that builds the traces, tasks or model changes."""
    import gradscope.trainers.tasks.code as code
    import gradscope.trainers.tasks.math as math_tasks
    import gradscope.trainers.testbed.model as model
    import gradscope.trainers.testbed.tokenizer as tokenizer
    import gradscope.trainers.testbed.warmstart as warmstart
    import gradscope.trainers.workflows.templates as templates

    h = hashlib.sha256(config_id(cfg).encode())
    for module in (warmstart, code, math_tasks, model, tokenizer, templates):
        h.update(inspect.getsource(module).encode())
    h.update(json.dumps(BUILD_ENV, sort_keys=True).encode())
    h.update(torch.__version__.encode())
    return h.hexdigest()[:16]


def weights_digest(state: dict[str, torch.Tensor]) -> str:
    """sha256 of a state dict's tensors (fp32 bytes, in key order): equal iff the weights are bit-equal."""
    h = hashlib.sha256()
    for name in sorted(state):
        h.update(name.encode())
        h.update(state[name].detach().to(torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def pinned_digest(cfg: WarmStartConfig) -> str | None:
    """The digest every machine's build of ``cfg`` must have, or None if it is not pinned."""
    pins = json.loads(PINNED.read_text()) if PINNED.exists() else {}
    return pins.get(config_id(cfg), {}).get("digest")


def pin_status(cfg: WarmStartConfig) -> tuple[str, str]:
    """(the cached warm start's :func:`weights_digest`, ``pinned`` | ``differs from the pin`` (this
    machine's float kernels or the warm-start code are not those of the pin) | ``not pinned``)."""
    digest = _file_digest(cached_path(cfg))
    pinned = pinned_digest(cfg)
    return digest, "not pinned" if pinned is None else "pinned" if digest == pinned else "differs from the pin"


def provenance(cfg: WarmStartConfig) -> str:
    """What a run file records of its testbed (``versions["testbed"]``): the first 16 hex digits of the
    warm start's digest and its :func:`pin_status`, e.g. ``a88f4f3bdef367c7 (pinned)``."""
    digest, status = pin_status(cfg)
    return f"{digest[:16]} ({status})"


@functools.lru_cache(maxsize=None)
def _file_digest(path: Path) -> str:
    return weights_digest(torch.load(path, weights_only=True))


def cached_path(cfg: WarmStartConfig) -> Path:
    """Where the warm start of ``cfg`` is (or will be) cached."""
    return cache_dir() / "testbed" / f"warmstart-{cache_key(cfg)}.pt"


def warm_started_model(cfg: WarmStartConfig = WarmStartConfig(), *, verbose: bool = False) -> torch.nn.Module:
    """The warm-started testbed base model (eval mode): from the cache, else built (once) and cached."""
    path = cached_path(cfg)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with _locked(path.with_suffix(".lock"), verbose):
            if not path.exists():  # another process may have built it while we waited
                _build(cfg, path, verbose)
    model = build_testbed_model(cfg.seed, **cfg.model_sizes())
    model.load_state_dict(torch.load(path, weights_only=True))
    return model.eval()


@contextmanager
def _locked(lock: Path, verbose: bool) -> Iterator[None]:
    with open(lock, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if verbose:
                print(f"waiting for another process to finish building the testbed warm start ({lock}) ...",
                      flush=True)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build(cfg: WarmStartConfig, path: Path, verbose: bool) -> None:
    """Build in a child process with :data:`BUILD_ENV`, showing its progress; atomic rename into ``path``."""
    total = cfg.skill_steps + cfg.role_steps
    if verbose:
        print(f"building the testbed warm start once ({total} supervised steps, about "
              f"{EXPECTED_SECONDS * total // 700} s on an idle core; cached at {path})", flush=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    cmd = [sys.executable, "-m", "gradscope.trainers.testbed.cache", "build",
           json.dumps(dataclasses.asdict(cfg)), str(tmp)]
    t0 = time.monotonic()
    bar = None
    if verbose:
        from tqdm import tqdm

        bar = tqdm(total=total, desc="warm start", unit="step", dynamic_ncols=True, file=sys.stdout)
    try:
        with subprocess.Popen(cmd, env={**os.environ, **BUILD_ENV}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) as child:
            for line in child.stdout:  # "<steps done>" lines
                if bar is not None and line.strip().isdigit():
                    bar.n = int(line)
                    bar.refresh()
            err = child.stderr.read()
        if child.returncode != 0:
            raise RuntimeError(f"building the testbed warm start failed (exit {child.returncode}): "
                               f"{err.strip().splitlines()[-1] if err.strip() else 'no message'}")
        tmp.replace(path)  # atomic: a reader never sees a half-written file
    finally:
        if bar is not None:
            bar.close()
        tmp.unlink(missing_ok=True)
    if verbose:
        print(f"built the testbed warm start in {time.monotonic() - t0:.0f} s", flush=True)


def main(argv: list[str] | None = None) -> int:
    """``python -m gradscope.trainers.testbed.cache build CONFIG_JSON OUT`` (the child of :func:`_build`),
    ``... pin [SCALE ...]``: build (or load) the warm start of every scale (or of those named) and
    record its digest in ``pinned.json``, or ``... verify [SCALE ...]``: compare them with the pins."""
    parser = argparse.ArgumentParser(prog="python -m gradscope.trainers.testbed.cache")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("build")
    p.add_argument("config")
    p.add_argument("out")
    for command, what, default in (
            ("pin", "record the digests of the warm starts built here in pinned.json", list(SCALES)),
            ("verify", "build (or load) each warm start and say whether it has the pinned bytes; exit 1 if one "
                       "differs", ["0.3M"])):
        p = sub.add_parser(command, help=what)
        p.add_argument("scales", nargs="*", metavar="SCALE", default=default,
                       help=f"scales: {', '.join(SCALES)} (default: {', '.join(default)})")
    args = parser.parse_args(argv)
    unknown = [s for s in getattr(args, "scales", []) if s not in SCALES]
    if unknown:
        parser.error(f"unknown scale(s) {unknown}; use {', '.join(SCALES)}")
    if args.command == "verify":
        differ = False
        for scale in args.scales:
            warm_started_model(SCALES[scale], verbose=True)
            differ |= pin_status(SCALES[scale])[1] == "differs from the pin"
            print(f"{scale}: {provenance(SCALES[scale])}")
        return int(differ)
    if args.command == "pin":
        pins = json.loads(PINNED.read_text()) if PINNED.exists() else {}
        for scale in args.scales:
            cfg = SCALES[scale]
            digest = weights_digest(warm_started_model(cfg, verbose=True).state_dict())
            pins[config_id(cfg)] = {"digest": digest, "scale": scale, "config": dataclasses.asdict(cfg)}
            PINNED.write_text(json.dumps(pins, indent=1, sort_keys=True) + "\n")
            print(f"pinned {scale} ({config_id(cfg)}): {digest}")
        return 0
    torch.use_deterministic_algorithms(True)
    cfg = WarmStartConfig(**json.loads(args.config))
    model = train_warm_start(cfg, on_step=lambda step, total: (step % 10 == 0 or step == total)
                             and print(step, flush=True))
    torch.save(model.state_dict(), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
