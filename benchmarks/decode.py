"""Per-token decode time of a composed model, side by side in one run.

Columns (all greedy, KV-cached, prompt of 16 tokens, EOS disabled so every run decodes the same length):

* ``background`` — the background alone through the same decoding loop (``ComposedLM`` with no experts);
* ``bg at 3·B`` — the same, on the prompt repeated 3 times: the cost of the adapters backend's base
  forward with zero-cost LoRA (the bound any mixed-adapter batch can reach);
* ``HF generate`` — the background's own ``model.generate`` (for reference);
* ``adapters`` — background + 2 LoRA experts on the adapters backend (one PeftModel, one mixed-adapter
  forward of batch 3·B per step);
* ``separate`` — background + the 2 LoRA experts merged into full copies (three forwards per step).

Per-token time = (time to generate N+1 tokens − time to generate 1 token) / N, so the prefill is not
counted; the median over repetitions (configurations interleaved within each repetition) is reported.

Usage::

    python benchmarks/decode.py [--new-tokens 64] [--reps 5] [--threads N] [--out benchmarks/RESULTS_decode.md]

``--threads`` is left to torch's default unless given. On a machine other processes are loading, 2
intra-op threads wait on each other at every op barrier and times blow up by 10-400x; the script
prints the load average so such runs can be recognised (use ``--threads 1`` there).
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from compose import ComposedLM  # noqa: E402

MODELS = {
    # name: (hidden, intermediate, layers, heads)
    "llama-1M": (128, 384, 4, 4),
    "llama-10M": (384, 1024, 6, 6),
}
VOCAB, PROMPT = 256, 16
LORA = dict(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0)


def build(name: str, seed: int = 0):
    hidden, inter, layers, heads = MODELS[name]
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=512)
    background = LlamaForCausalLM(config).eval()
    n_params = sum(p.numel() for p in background.parameters())
    peft_model = get_peft_model(copy.deepcopy(background), LoraConfig(**LORA), adapter_name="e1")
    peft_model.add_adapter("e2", LoraConfig(**LORA))
    with torch.no_grad():
        for pname, p in peft_model.named_parameters():
            if "lora_B" in pname:
                p.normal_(0, 0.02)
    peft_model.eval()
    merged = [copy.deepcopy(peft_model).merge_and_unload(adapter_names=[n]).eval() for n in ("e1", "e2")]
    runners = {
        "background": ComposedLM(background),
        "bg at 3·B": ComposedLM(background),
        "HF generate": background,
        "adapters": ComposedLM.from_peft(peft_model, ["e1", "e2"]),
        "separate": ComposedLM(background, merged, names=["e1", "e2"]),
    }
    return n_params, runners


def run(runner, ids: torch.Tensor, n: int) -> float:
    start = time.perf_counter()
    if isinstance(runner, ComposedLM):
        out = runner.generate(ids, max_new_tokens=n, eos_token_id=[])  # [] = no EOS stopping
    else:
        out = runner.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, eos_token_id=None, pad_token_id=0)
    elapsed = time.perf_counter() - start
    assert out.shape[1] == ids.shape[1] + n, out.shape
    return elapsed


def measure(runners: dict, batch: int, new_tokens: int, reps: int) -> dict[str, float]:
    ids = torch.randint(3, VOCAB, (batch, PROMPT), generator=torch.Generator().manual_seed(batch))
    inputs = {k: ids.repeat(3, 1) if k == "bg at 3·B" else ids for k in runners}
    for key, runner in runners.items():  # warm-up
        run(runner, inputs[key], new_tokens + 1)
    samples: dict[str, list[float]] = {k: [] for k in runners}
    for _ in range(reps):  # configurations interleaved within each repetition
        for key, runner in runners.items():
            full = run(runner, inputs[key], new_tokens + 1)
            prefill = run(runner, inputs[key], 1)
            samples[key].append((full - prefill) / new_tokens * 1e3)
    return {k: statistics.median(v) for k, v in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: leave it)")
    parser.add_argument("--out", type=Path, default=None, help="also write the table to this markdown file")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    header = ("| model | params | batch | background ms/tok | bg at 3·B ms/tok | HF generate ms/tok | "
              "adapters ms/tok | separate ms/tok | adapters / background | separate / adapters |")
    lines = [header, "|" + "---|" * 10]
    for name in args.models:
        n_params, runners = build(name)
        for batch in args.batches:
            t = measure(runners, batch, args.new_tokens, args.reps)
            lines.append(
                f"| {name} | {n_params / 1e6:.2f} M | {batch} | {t['background']:.2f} | {t['bg at 3·B']:.2f} | "
                f"{t['HF generate']:.2f} | "
                f"{t['adapters']:.2f} | {t['separate']:.2f} | {t['adapters'] / t['background']:.2f}x | "
                f"{t['separate'] / t['adapters']:.2f}x |"
            )
            print(lines[-1] if len(lines) > 3 else "\n".join(lines), flush=True)
    setup = (
        f"torch {torch.__version__}, {torch.get_num_threads()} threads on {os.cpu_count()} CPUs "
        f"(load average {load0:.1f} at start, {os.getloadavg()[0]:.1f} at end), {platform.machine()}, "
        f"CPU; greedy, prompt {PROMPT}, {args.new_tokens} new tokens, median of {args.reps}; "
        f"LoRA r={LORA['r']} on all linear layers; background = ComposedLM with no experts (same loop); "
        f"total {time.perf_counter() - t0:.0f} s"
    )
    print(setup)
    if args.out is not None:
        args.out.write_text(
            "# Decode benchmark\n\n`python benchmarks/decode.py " + " ".join(sys.argv[1:]) + "`\n\n"
            + "\n".join(lines) + "\n\n" + setup + "\n"
        )


if __name__ == "__main__":
    main()
