"""Peak memory of ``ComposedLM.score`` on a large vocabulary, by sequence length and position chunk.

A tiny random Llama with a 256k vocabulary (hidden size 32, 2 layers) and k LoRA experts (adapters
backend); one sequence of T tokens is scored with ``score(..., chunk_size=c)``. Each configuration runs in
its own process; its resident-set high-water mark is reset just before the call, so

* ``peak MB`` = the highest RSS during ``score`` minus the RSS just before it (everything ``score``
  allocates, the ``[B, T, V]`` float32 result included);
* ``result MB`` = that result's own size (B·T·V·4 bytes);
* ``peak − result`` = what the computation holds besides its result, which should grow with the chunk c
  and not with T (the unchunked computation holds (k+1)·B·T·V float32 logits and their log-softmaxes).

Usage::

    python benchmarks/score_memory.py [--lengths 256 512 1024] [--chunks 16 64 256 0] [--experts 2]
        [--vocab 256000] [--out benchmarks/RESULTS_score_memory.md]

``0`` in ``--chunks`` is ``score``'s default chunk (``compose.composed_lm.score_chunk_size``).
"""

from __future__ import annotations

import argparse
import json
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


def probe(vocab: int, length: int, chunk: int, k: int) -> dict:
    """Peak RSS (MB) above the RSS before one ``score`` call of a [1, length] sequence."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=length)
    peft_model = with_lora_experts(LlamaForCausalLM(config).eval(), k)
    composed = ComposedLM.from_peft(peft_model, [f"e{i}" for i in range(1, k + 1)])
    ids = torch.randint(3, vocab, (1, length), generator=torch.Generator().manual_seed(0))
    before = _rss_mb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak RSS to the current RSS
    start = time.perf_counter()
    out = composed.score(ids, chunk_size=chunk or None)
    seconds = time.perf_counter() - start
    used = chunk or score_chunk_size(k + 1, 1, vocab)
    return {"peak_mb": _rss_mb("VmHWM") - before, "result_mb": out.numel() * 4 / 2**20, "chunk": used,
            "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--chunks", type=int, nargs="+", default=[16, 64, 256, 0])
    parser.add_argument("--experts", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=256_000)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--probe", nargs=2, type=int, metavar=("LENGTH", "CHUNK"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.probe:
        print(json.dumps(probe(args.vocab, args.probe[0], args.probe[1], args.experts)))
        return
    k, vocab = args.experts, args.vocab
    lines = ["| T | chunk c | peak MB | result MB | peak − result MB | (k+1)·B·c·V float32 MB | "
             "(k+1)·B·T·V float32 MB (unchunked logits) | seconds |", "|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for length in args.lengths:
        for chunk in args.chunks:
            cmd = [sys.executable, __file__, "--probe", str(length), str(chunk), "--experts", str(k),
                   "--vocab", str(vocab)]
            r = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
            c = r["chunk"]
            lines.append(f"| {length} | {c}{' (default)' if chunk == 0 else ''} | {r['peak_mb']:.0f} | "
                         f"{r['result_mb']:.0f} | {r['peak_mb'] - r['result_mb']:.0f} | "
                         f"{(k + 1) * min(c, length) * vocab * 4 / 2**20:.0f} | {(k + 1) * length * vocab * 4 / 2**20:.0f} | "
                         f"{r['seconds']:.1f} |")
            print(lines[-1], flush=True)
    setup = (f"V = {vocab}, k = {k} LoRA experts (adapters backend), B = 1, tiny Llama (hidden 32, 2 layers), "
             f"torch {torch.__version__}, 1 thread, CPU; each row its own process")
    print(setup)
    if args.out is not None:
        args.out.write_text("# Memory of `ComposedLM.score` on a large vocabulary\n\n`python benchmarks/score_memory.py "
                            + " ".join(sys.argv[1:]) + "`\n\n" + "\n".join(lines) + "\n\n" + setup + "\n")


if __name__ == "__main__":
    main()
