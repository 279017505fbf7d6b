"""Peak memory of one expert training step (task NLL + off-mask regularizer, forward and backward) on a large
vocabulary, plain (`expert.loss_chunk_size: null`) and block by block of positions (`loss_chunk_size: c`).

A tiny random Llama with a 256k vocabulary (hidden size 32, 2 layers) under two LoRA experts (`ExpertLM`,
mode lora, forward KL at temperature 3, λ = 3); B rows of T tokens, the first ones a prompt, the rest targets, a
fifth of the targets on the row's own mask. Each configuration runs in its own process; its resident-set
high-water mark is reset just before the step, so ``peak MB`` = the highest RSS during `training_step` +
`backward` minus the RSS just before it. The probes run with glibc's mmap threshold fixed at 1 MiB
(``MALLOC_MMAP_THRESHOLD_``): every tensor above it goes back to the system when freed, so the peak counts what the
step holds, not what the allocator kept of freed blocks (by default glibc raises the threshold to 32 MiB once such
blocks are freed, and keeps smaller ones in its heap: ``--glibc-default`` measures that). Plain, the step holds the expert's and the background's `[B, T, V]`
logits and their float32 log-softmaxes (and the gradient of the expert's); chunked, ~`B·c·V` of them at a time.

Usage::

    python benchmarks/regularizer_memory.py [--lengths 512 1024] [--chunks 0 16 64] [--batch 1]
        [--vocab 256000] [--glibc-default] [--out FILE]

``0`` in ``--chunks`` is the plain step (``loss_chunk_size=None``).
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
from decode import _rss_mb  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from lightning_modules.expert import ExpertLM, ExpertSettings  # noqa: E402


def training_batch(batch: int, length: int, vocab: int) -> dict[str, torch.Tensor]:
    """`batch` full rows alternating between the two experts: a 16-token prompt, then targets (a fifth on the mask)."""
    gen = torch.Generator().manual_seed(0)
    targets = torch.randint(3, vocab, (batch, length), generator=gen)
    targets[:, :15] = -100
    index = torch.arange(batch) % 2
    return {"input_ids": torch.randint(3, vocab, (batch, length), generator=gen),
            "attention_mask": torch.ones(batch, length, dtype=torch.long), "targets": targets,
            "masks": ((torch.rand(batch, 1, length, generator=gen) < 0.2) & (targets != -100).unsqueeze(1)),
            "expert_index": index, "is_task": torch.ones(batch, dtype=torch.long),
            "task_on_mask": torch.zeros(batch, dtype=torch.long), "output_start": torch.full((batch,), 16)}


class _NotLogging(ExpertLM):
    """An `ExpertLM` at an odd step: no per-expert metrics (most steps, `log_every_n_steps`), no Trainer."""

    global_step = 1


def probe(vocab: int, length: int, chunk: int, batch: int) -> dict:
    """Peak RSS (MB) above the RSS before one training step (forward and backward)."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=length)
    settings = ExpertSettings(lora_r=4, reg_weight=3.0, temperature=3.0, log_every_n_steps=2,
                              loss_chunk_size=chunk or None)
    module = _NotLogging(LlamaForCausalLM(config), ["e1", "e2"], settings)
    module.log = lambda *args, **kwargs: None
    data = training_batch(batch, length, vocab)
    before = _rss_mb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak RSS to the current RSS
    start = time.perf_counter()
    loss = module.training_step(data, 0)
    loss.backward()
    seconds = time.perf_counter() - start
    return {"peak_mb": _rss_mb("VmHWM") - before, "loss": loss.item(), "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024])
    parser.add_argument("--chunks", type=int, nargs="+", default=[0, 16, 64])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--vocab", type=int, default=256_000)
    parser.add_argument("--glibc-default", action="store_true", help="leave glibc's mmap threshold dynamic")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--probe", nargs=2, type=int, metavar=("LENGTH", "CHUNK"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.probe:
        print(json.dumps(probe(args.vocab, args.probe[0], args.probe[1], args.batch)))
        return
    b, vocab = args.batch, args.vocab
    lines = ["| T | loss_chunk_size | peak MB | plain peak ÷ this peak | B·T·V float32 MB | B·c·V float32 MB | loss | "
             "seconds |", "|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    env = dict(os.environ) if args.glibc_default else {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    for length in args.lengths:
        plain = None
        for chunk in args.chunks:
            cmd = [sys.executable, __file__, "--probe", str(length), str(chunk), "--batch", str(b),
                   "--vocab", str(vocab)]
            run = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
            r = json.loads(run.stdout.splitlines()[-1])
            plain = r["peak_mb"] if chunk == 0 else plain
            ratio = "" if plain is None else f"{plain / r['peak_mb']:.1f}"
            lines.append(f"| {length} | {chunk or 'null (plain)'} | {r['peak_mb']:.0f} | {ratio} | "
                         f"{b * length * vocab * 4 / 2**20:.0f} | "
                         f"{'' if not chunk else f'{b * min(chunk, length) * vocab * 4 / 2**20:.0f}'} | "
                         f"{r['loss']:.6f} | {r['seconds']:.1f} |")
            print(lines[-1], flush=True)
    setup = (f"V = {vocab}, B = {b}, 2 LoRA experts (r = 4, all linear layers of the blocks), forward KL at T = 3, "
             f"λ = 3, tiny Llama (hidden 32, 2 layers), torch {torch.__version__}, 1 thread, CPU; each row its own "
             "process; the step: training_step + backward; glibc mmap threshold "
             + ("dynamic (default)" if args.glibc_default else "1 MiB"))
    print(setup)
    if args.out is not None:
        args.out.write_text("`python benchmarks/regularizer_memory.py " + " ".join(sys.argv[1:]) + "`\n\n"
                            + "\n".join(lines) + "\n\n" + setup + "\n")


if __name__ == "__main__":
    main()
