"""Lazy gated experts: per-token decode time of the background, gated composition, and lazy gated, side by side.

On trained exports (adapters backend, batch 1, greedy, EOS on), for sets of prompts whose outputs hold a small
or a large share of tokens inside the experts' intervals, columns:

* ``coverage`` — share of the generated tokens predicted with some expert's gate open (measured on the
  composed output with :meth:`ComposedLM.interval_masks`: the steps where lazy decoding must run an expert);
* ``background`` — the background alone (``ComposedLM`` with no experts on the same PeftModel);
* ``gated`` — gated composition as usual: every expert's forward at every step (one (k+1)-row batch);
* ``lazy`` — ``generate(..., lazy=True)``: the experts whose interval is closed are skipped (the prompt's
  prefill too) and caught up by one prefill of the tokens they missed when it opens;
* ``lazy decode`` — ``generate(..., lazy="decode")``: every expert prefills the prompt with the background (as
  gated does), only decoding steps are skipped, so a catch-up covers only generated tokens;
* ``decode ms/token`` = time from the first token's composition to the last one's / (tokens − 1), stamped at
  each step's ``compose_logprobs`` call: the prompt's prefill is not counted (lazy's catch-up prefills are,
  they happen while decoding: with ``lazy`` the first catch-up of an expert includes the prompt); ``total ms/token`` =
  time of the whole generation / tokens, prefill included. Each prompt's times are minima over ``--reps``
  repetitions (the four runs interleaved in each; the minimum, not the median, because other processes
  share the CPU and only ever add time), then summed over the set's prompts.
* ``gates ms/token`` — the share of that spent in the stopping-time detectors (replayed on the gated output):
  gated and lazy pay it, the background does not.
* ``same tokens`` — lazy output equals gated output token for token on every prompt (checked first).

Exports: (a) the interval task (``runs/intervals_s0/export``: experts ``upper`` on ``[ ]`` and ``reverse`` on
``( )``; inputs of 20 random letters holding one short segment — low coverage — or two longer ones), (b) the
SmolLM2 skill experiment (``runs/smollm2_skills_s0/export``: ``calc`` on ``<< >>``, ``upper`` on ``[ ]``; chat
prompts of configs/experiment/data/smollm2_skills: ``general`` rows (no interval), long messages joining
general sentences with one upper row (low coverage), and the ``compositional`` rows).

Usage::

    OMP_NUM_THREADS=1 python benchmarks/lazy_decode.py [--intervals EXPORT] [--smollm2 EXPORT] [--prompts 8]
        [--smollm2-prompts 3] [--reps 3] [--threads 1] [--sets NAME ...] [--catch-up-alone] [--out FILE [--append]]

``--sets`` keeps the prompt sets whose name contains one of the given words (to split a long run: each
process stays short); ``--append`` adds the rows to ``--out`` instead of rewriting it.

``--smollm2 none`` (or ``--intervals none``) skips that export.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import compose.composed_lm as composed_lm  # noqa: E402
import compose.decoding as decoding  # noqa: E402
from compose import ComposedLM  # noqa: E402

SMOLLM2_DATA = ROOT / "configs/experiment/data/smollm2_skills"
MODES = ("background", "gated", "lazy", "lazy decode")


# ------------------------------------------------------------------------------------------- prompts


def interval_inputs(n: int, segments: list[tuple[str, str, int, int]], length: int = 20, seed: int = 0) -> list[str]:
    """``n`` texts of ``length`` characters: random lowercase letters holding one segment per
    ``(start, end, min content, max content)``, in random order, never touching."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    texts = []
    for _ in range(n):
        segs = [s + "".join(rng.choices(letters, k=rng.randint(lo, hi))) + e for s, e, lo, hi in segments]
        rng.shuffle(segs)
        plain = length - sum(map(len, segs))
        cuts = sorted(rng.sample(range(1, plain), len(segs)))  # a letter before, between and after segments
        pieces, last = [], 0
        for cut, seg in zip(cuts, segs, strict=True):
            pieces += ["".join(rng.choices(letters, k=cut - last)), seg]
            last = cut
        texts.append("".join(pieces) + "".join(rng.choices(letters, k=plain - last)))
    return texts


def interval_prompts(tokenizer, n: int) -> dict[str, list[tuple[list[int], int]]]:
    """Prompt sets of the interval task: ``(ids <bos> x <sep>, max_new_tokens len(x) + 2)`` each."""
    sets = {
        "one short segment": interval_inputs(n, [("[", "]", 1, 2)], seed=1) [: n // 2]
        + interval_inputs(n, [("(", ")", 1, 2)], seed=2)[: n - n // 2],
        "two segments of 3-5": interval_inputs(n, [("[", "]", 3, 5), ("(", ")", 3, 5)], seed=3),
    }
    ids = lambda x: [tokenizer.bos_token_id, *tokenizer.convert_tokens_to_ids(list(x)), tokenizer.sep_token_id]  # noqa: E731
    return {name: [(ids(x), len(x) + 2) for x in xs] for name, xs in sets.items()}


def _rows(name: str) -> list[list[dict]]:
    with open(SMOLLM2_DATA / f"{name}.jsonl") as f:
        return [json.loads(line)["messages"] for line in f]


def smollm2_prompts(tokenizer, n: int) -> dict[str, list[tuple[list[int], int]]]:
    """Chat prompt sets of the SmolLM2 skill experiment (the last assistant turn is to be generated)."""
    general, upper, compositional = _rows("general"), _rows("upper"), _rows("compositional")

    def joined(i: int) -> list[dict]:  # three general sentences and one upper row: one short interval
        text = " ".join([general[3 * i][1]["content"], general[3 * i + 1][1]["content"], upper[i][1]["content"],
                         general[3 * i + 2][1]["content"]])
        return [general[0][0], *({"role": r, "content": text} for r in ("user", "assistant", "user"))]

    sets = {"general (no interval)": general[:n], "long, one [ ] interval": [joined(i) for i in range(n)],
            "compositional": compositional[:n]}
    out = {}
    for name, rows in sets.items():
        prompts = []
        for messages in rows:
            last = max(i for i, m in enumerate(messages) if m["role"] == "user") + 1
            text = tokenizer.apply_chat_template(messages[:last], tokenize=False, add_generation_prompt=True)
            prompts.append((tokenizer(text, add_special_tokens=False).input_ids, 64))
        out[name] = prompts
    return out


# ------------------------------------------------------------------------------------------- timing


def generate(model: ComposedLM, ids: torch.Tensor, n: int, lazy: bool | str) -> torch.Tensor:
    return model.generate(ids, torch.ones_like(ids), max_new_tokens=n, lazy=lazy)


class StepClock:
    """Time stamps of every decoding step: ``compose_logprobs`` is called once per step of ``ComposedLM.generate``
    (after the prompt's forward, then after each step's forward); the clock wraps it while installed."""

    def __init__(self) -> None:
        self.stamps: list[float] = []
        self._inner = composed_lm.compose_logprobs

    def __enter__(self) -> StepClock:
        def stamped(*args, **kwargs):
            self.stamps.append(time.perf_counter())
            return self._inner(*args, **kwargs)

        composed_lm.compose_logprobs = stamped
        return self

    def __exit__(self, *exc) -> None:
        composed_lm.compose_logprobs = self._inner


def timed(model: ComposedLM, ids: torch.Tensor, n: int, lazy: bool | str) -> tuple[float, float, int]:
    """One generation: (seconds of its decoding steps after the first token, seconds in all, generated tokens)."""
    with StepClock() as clock:
        start = time.perf_counter()
        out = generate(model, ids, n, lazy)
        whole = time.perf_counter() - start
    return clock.stamps[-1] - clock.stamps[0], whole, out.shape[1] - ids.shape[1]


def coverage_steps(model: ComposedLM, out: torch.Tensor, prompt_len: int) -> tuple[int, int]:
    """(steps with some gate open, generated tokens) of a batch-1 output."""
    masks = model.interval_masks(out, prompt_len)[:, 0, prompt_len - 1 : -1]  # gates of each generated token
    return int(masks.any(0).sum()), masks.shape[-1]


def gate_seconds(model: ComposedLM, out: torch.Tensor, prompt_len: int) -> float:
    """Time of the gates' calls of one batch-1 generation, replayed on its output."""
    from compose.gating import gates_from_specs

    gates = gates_from_specs(model.specs, model.tokenizer, prompt_len)
    start = time.perf_counter()
    for t in range(prompt_len, out.shape[1]):
        for gate in gates:
            if gate is not None:
                gate(out[:, :t])
    return time.perf_counter() - start


def measure(composed: ComposedLM, background: ComposedLM, prompts: list[tuple[list[int], int]], reps: int) -> dict:
    """Coverage, token check and summed minimum times of the four runs over one prompt set."""
    runners = {"background": (background, False), "gated": (composed, False), "lazy": (composed, True),
               "lazy decode": (composed, "decode")}
    open_steps = steps = 0
    gates = 0.0
    same = True
    decode = dict.fromkeys(MODES, 0.0)
    total = dict.fromkeys(MODES, 0.0)
    tokens = dict.fromkeys(MODES, 0)
    for ids, n in prompts:
        ids = torch.tensor([ids])
        gated = generate(composed, ids, n, False)
        same &= all(torch.equal(gated, generate(composed, ids, n, mode)) for mode in (True, "decode"))
        o, s = coverage_steps(composed, gated, ids.shape[1])
        open_steps, steps = open_steps + o, steps + s
        gates += min(gate_seconds(composed, gated, ids.shape[1]) for _ in range(reps))
        generate(background, ids, n, False)  # warm-up (the composed model ran above)
        times: dict[str, list[tuple[float, float, int]]] = {m: [] for m in MODES}
        for _ in range(reps):
            for mode, (model, is_lazy) in runners.items():
                times[mode].append(timed(model, ids, n, is_lazy))
        for mode in MODES:
            decode[mode] += min(t[0] for t in times[mode])
            total[mode] += min(t[1] for t in times[mode])
            tokens[mode] += times[mode][0][2]
    return {
        "prompts": len(prompts), "coverage": open_steps / max(steps, 1), "same": same,
        "decode": {m: 1e3 * decode[m] / max(tokens[m] - len(prompts), 1) for m in MODES},
        "total": {m: 1e3 * total[m] / max(tokens[m], 1) for m in MODES},
        "tokens": tokens, "gates": 1e3 * gates / max(steps, 1),
    }


# ------------------------------------------------------------------------------------------- report


HEADER = ("| export | prompts | n | coverage | decode ms/token: bg / gated / lazy / lazy decode | gated / bg | "
          "**lazy / bg** | **lazy decode / bg** | total ms/token: bg / gated / lazy / lazy decode | "
          "total: gated / bg | lazy / bg | lazy decode / bg | gates ms/token | same tokens |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def row(export: str, name: str, r: dict) -> str:
    d, t = r["decode"], r["total"]
    times = lambda x: " / ".join(f"{x[m]:.2f}" for m in MODES)  # noqa: E731
    ratio = lambda x, m: f"{x[m] / x['background']:.2f}×"  # noqa: E731
    return (f"| {export} | {name} | {r['prompts']} | {100 * r['coverage']:.0f} % | {times(d)} | {ratio(d, 'gated')} | "
            f"**{ratio(d, 'lazy')}** | **{ratio(d, 'lazy decode')}** | {times(t)} | {ratio(t, 'gated')} | "
            f"{ratio(t, 'lazy')} | {ratio(t, 'lazy decode')} | {r['gates']:.2f} | {'yes' if r['same'] else 'NO'} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--intervals", default=str(ROOT / "runs/intervals_s0/export"))
    parser.add_argument("--smollm2", default=str(ROOT / "runs/smollm2_skills_s0/export"))
    parser.add_argument("--prompts", type=int, default=8, help="prompts per set of the interval task")
    parser.add_argument("--smollm2-prompts", type=int, default=3, help="prompts per set of SmolLM2")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--sets", nargs="*", default=None, help="only the prompt sets whose name contains one of these")
    parser.add_argument("--catch-up-alone", action="store_true",
                        help="every catch-up a prefill of its own (decoding.FUSED_CATCH_UP_TOKENS = 0) instead of "
                             "short catch-ups joining the step's forward")
    parser.add_argument("--out", default=None, help="also write the table to this markdown file")
    parser.add_argument("--append", action="store_true", help="append the rows (and footer) to --out")
    args = parser.parse_args()
    from lightning_modules.pipeline.console import quiet

    quiet()  # the table only: no loading bars or library deprecation notices between its rows
    torch.set_num_threads(args.threads)
    if args.catch_up_alone:
        decoding.FUSED_CATCH_UP_TOKENS = 0
    start, load = time.perf_counter(), os.getloadavg()[0]
    lines = [HEADER]
    print(HEADER, flush=True)
    for export, path, make, n in (("interval task", args.intervals, interval_prompts, args.prompts),
                                  ("SmolLM2 skills", args.smollm2, smollm2_prompts, args.smollm2_prompts)):
        if path.lower() == "none":
            continue
        composed = ComposedLM.from_manifest(path, composition="gated")
        background = ComposedLM.from_peft(composed.model, [], tokenizer=composed.tokenizer)
        for name, prompts in make(composed.tokenizer, n).items():
            if args.sets and not any(part in name for part in args.sets):
                continue
            line = row(export, name, measure(composed, background, prompts, args.reps))
            lines.append(line)
            print(line, flush=True)
    footer = (f"\n{torch.get_num_threads()} thread(s), {platform.machine()}, torch {torch.__version__}, "
              f"catch-ups fused up to {decoding.FUSED_CATCH_UP_TOKENS} tokens, "
              f"load average {load:.1f} at start, {os.getloadavg()[0]:.1f} at end, {time.perf_counter() - start:.0f} s")
    print(footer)
    if args.out:
        out = Path(args.out)
        if args.append and out.exists():
            with out.open("a") as f:
                f.write("\n".join(lines[1:]) + "\n" + footer.strip() + "\n")
        else:
            out.write_text("\n".join(lines) + "\n" + footer + "\n")


if __name__ == "__main__":
    main()
