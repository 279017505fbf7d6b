"""Peak memory of ``ComposedLM.score`` on a large vocabulary, by sequence length and position chunk, with one
output head and without.

A tiny random Llama with Gemma-3's 262,144-token vocabulary (hidden size 32, 2 layers) and k LoRA experts (adapters
backend, all linear layers of the blocks: the output head is not adapted, so one head applies); one sequence of T
tokens is scored with ``score(..., chunk_size=c)`` on each path:

* ``one_head``: the head runs once per block on the mixed hidden states (``ComposedLM.from_peft(..., one_head=True)``),
  a block holds B·c·V float32 logits, the size of one component's block;
* ``plain``: one head per component (``one_head=False``), a block holds (k+1)·B·c·V.

Each configuration runs in its own process; its resident-set high-water mark is reset just before the call, so

* ``peak MB`` = the highest RSS during ``score`` minus the RSS just before it (everything ``score``
  allocates, the ``[B, T, V]`` float32 result included);
* ``result MB`` = that result's own size (B·T·V·4 bytes);
* ``peak − result`` = what the computation holds besides its result, which should grow with the chunk c
  and not with T.

The probes run with glibc's mmap threshold fixed at 1 MiB (``MALLOC_MMAP_THRESHOLD_``) so that the peak counts what
``score`` holds, not what the allocator kept of freed blocks (``--glibc-default`` leaves it dynamic). Before the
table, one more process scores a short sequence on both paths and prints their largest absolute difference.

Usage::

    python benchmarks/score_memory.py [--lengths 512 1024] [--chunks 16 64 0] [--experts 2]
        [--paths one_head plain] [--vocab 262144] [--check-length 64] [--glibc-default] [--out FILE]

``0`` in ``--chunks`` is ``score``'s default chunk (``compose.composed_lm.score_chunk_size``), which depends on the
path: a block of the default size holds at most 256 MiB of logits on either.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from decode import _rss_mb, with_lora_experts  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from compose import ComposedLM  # noqa: E402
from compose.composed_lm import score_chunk_size  # noqa: E402

PATHS = ("one_head", "plain")
MB = 2**20


def composed_models(vocab: int, length: int, k: int, paths: list[str]) -> dict[str, ComposedLM]:
    """One tiny random Llama with k LoRA experts, composed once per path (``{path: ComposedLM}``)."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=length)
    peft_model = with_lora_experts(LlamaForCausalLM(config).eval(), k)
    names = [f"e{i}" for i in range(1, k + 1)]
    # one_head=True raises (naming why) where the identity does not apply
    return {p: ComposedLM.from_peft(peft_model, names, one_head=p == "one_head") for p in paths}


def sequence(vocab: int, length: int) -> torch.Tensor:
    return torch.randint(3, vocab, (1, length), generator=torch.Generator().manual_seed(0))


def default_chunk(path: str, k: int, vocab: int) -> int:
    """``score``'s default positions per block on ``path`` (B = 1)."""
    return score_chunk_size(1 if path == "one_head" else k + 1, 1, vocab)


def probe(vocab: int, length: int, chunk: int, k: int, path: str) -> dict:
    """Peak RSS (MB) above the RSS before one ``score`` call of a [1, length] sequence on ``path``."""
    composed = composed_models(vocab, length, k, [path])[path]
    ids = sequence(vocab, length)
    if composed.paths.one_head != (path == "one_head"):
        raise RuntimeError(f"path {path!r} not taken: {composed.paths.describe()}")
    before = _rss_mb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak RSS to the current RSS
    start = time.perf_counter()
    out = composed.score(ids, chunk_size=chunk or None)
    seconds = time.perf_counter() - start
    return {"peak_mb": _rss_mb("VmHWM") - before, "result_mb": out.numel() * 4 / MB,
            "chunk": min(chunk or default_chunk(path, k, vocab), length), "seconds": seconds,
            "fallbacks": composed.floor_fallbacks}


def check(vocab: int, length: int, k: int) -> dict:
    """Both paths' scores of one short sequence: the largest absolute difference and each path's description."""
    models = composed_models(vocab, length, k, list(PATHS))
    ids = sequence(vocab, length)
    scores = {p: m.score(ids) for p, m in models.items()}
    return {"max_abs_diff": float((scores["one_head"] - scores["plain"]).abs().max()),
            "describe": {p: m.paths.describe() for p, m in models.items()},
            "fallbacks": models["one_head"].floor_fallbacks}


def run_probe(args: argparse.Namespace, env: dict, *flags: str) -> dict:
    """The last stdout line (JSON) of this script run in a fresh process with ``flags``."""
    cmd = [sys.executable, __file__, *flags, "--experts", str(args.experts), "--vocab", str(args.vocab)]
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout.splitlines()[-1])


def held(r: dict) -> float:
    """What a ``score`` call held besides its result (MB)."""
    return r["peak_mb"] - r["result_mb"]


def row(length: int, chunk: int, k: int, vocab: int, results: dict[str, dict]) -> str:
    """One table row: each path's chunk, peak and peak − result, the block sizes, and the ratios."""
    one, plain = results.get("one_head"), results.get("plain")

    def num(value: float | None, digits: int = 0) -> str:
        return "" if value is None else f"{value:.{digits}f}"

    component_block = one and one["chunk"] * vocab * 4 / MB  # B·c·V float32 at one head's c
    plain_block = plain and (k + 1) * plain["chunk"] * vocab * 4 / MB  # (k+1)·B·c·V float32 at plain's c
    cells = [
        str(length),
        " / ".join(str(results[p]["chunk"]) for p in PATHS if p in results) + (" (default)" if chunk == 0 else ""),
        num(one and one["peak_mb"]), num(plain and plain["peak_mb"]),
        num(next(iter(results.values()))["result_mb"]),
        num(one and held(one)), num(plain and held(plain)),
        num(one and plain and held(one) / held(plain), 2),
        num(component_block), num(plain_block),
        num(one and held(one) / component_block, 2),
        " / ".join(f"{results[p]['seconds']:.1f}" for p in PATHS if p in results),
    ]
    return "| " + " | ".join(cells) + " |"


HEADER = ["| T | chunk c (one head / plain) | one head peak MB | plain peak MB | result MB | one head peak − result MB | "
          "plain peak − result MB | one head ÷ plain (peak − result) | one component's block B·c·V·4, MB | "
          "plain block (k+1)·B·c·V·4, MB | one head peak − result ÷ one component's block | seconds (one head / plain) |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024])
    parser.add_argument("--chunks", type=int, nargs="+", default=[16, 64, 0])
    parser.add_argument("--experts", type=int, default=2)
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    parser.add_argument("--vocab", type=int, default=262_144)
    parser.add_argument("--check-length", type=int, default=64, help="the short sequence both paths score (0: skip)")
    parser.add_argument("--glibc-default", action="store_true", help="leave glibc's mmap threshold dynamic")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--probe", nargs=3, metavar=("LENGTH", "CHUNK", "PATH"), help=argparse.SUPPRESS)
    parser.add_argument("--check", type=int, metavar="LENGTH", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.probe:
        length, chunk, path = args.probe
        if path not in PATHS:
            raise ValueError(f"--probe path must be one of {PATHS}, got {path!r}")
        print(json.dumps(probe(args.vocab, int(length), int(chunk), args.experts, path)))
        return
    if args.check:
        print(json.dumps(check(args.vocab, args.check, args.experts)))
        return
    k, vocab = args.experts, args.vocab
    env = dict(os.environ) if args.glibc_default else {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    notes = []
    if args.check_length:
        c = run_probe(args, env, "--check", str(args.check_length))
        notes.append(f"one head: {c['describe']['one_head']}")
        notes.append(f"plain: {c['describe']['plain']}")
        notes.append(f"T = {args.check_length}: max |one head − plain| = {c['max_abs_diff']:.2e} "
                     f"({'within' if c['max_abs_diff'] <= 1e-4 else 'NOT within'} 1e-4)")
        print("\n".join(notes), flush=True)
    lines = list(HEADER)
    print("\n".join(lines), flush=True)
    fallbacks = 0
    for length in args.lengths:
        for chunk in args.chunks:
            results = {p: run_probe(args, env, "--probe", str(length), str(chunk), p) for p in PATHS if p in args.paths}
            fallbacks += sum(r["fallbacks"] for r in results.values())
            lines.append(row(length, chunk, k, vocab, results))
            print(lines[-1], flush=True)
    setup = (f"V = {vocab}, k = {k} LoRA experts (adapters backend), B = 1, tiny Llama (hidden 32, 2 layers), "
             f"torch {torch.__version__}, 1 thread, CPU; each path and row its own process; glibc mmap threshold "
             + ("dynamic (default)" if args.glibc_default else "1 MiB")
             + f"; score blocks where one head fell back to a head per component: {fallbacks}")
    print(setup)
    if args.out is not None:
        args.out.write_text("# Memory of `ComposedLM.score` on a large vocabulary\n\n`python benchmarks/score_memory.py "
                            + " ".join(sys.argv[1:]) + "`\n\n" + "\n".join(notes) + "\n\n" + "\n".join(lines)
                            + "\n\n" + setup + "\n")


if __name__ == "__main__":
    main()
