"""The lm-evaluation-harness model ``composed``: a :class:`compose.ComposedLM` export under lm-eval 0.4.x.

Importing this module registers the model::

    import compose.frontends.lm_eval  # noqa: F401
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    simple_evaluate(model="composed", model_args="manifest=EXPORT_DIR,batch_size=8",
                    tasks=["my_task"], task_manager=TaskManager(include_path="my_tasks/"))

or from a shell (tasks are checked before anything is loaded; an unknown name exits with status 2)::

    python -m compose.lm_eval --manifest EXPORT_DIR --tasks a,b --include_path my_tasks/ --output results.json

Requests are encoded, truncated, batched and cut exactly as lm-eval's own ``hf`` model (``HFLM``)
does for a causal LM: context/continuation split by :meth:`TemplateLM._encode_pair` (trailing spaces move
to the continuation; the tokenizer's special tokens, e.g. BOS, are added to the context unless it already
starts with BOS), left truncation to ``max_length + 1`` tokens, the same rolling windows for
``loglikelihood_rolling``, left-padded greedy generation that stops at ``until`` (and EOS) and cuts the
text at the first stop string. With no experts the results therefore equal ``hf``'s on the same task.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lm_eval.models  # noqa: F401  (lm-eval's own lazy model names, before ours: see lm_eval.api.registry.get_model)
import torch
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (
    Collator,
    _add_special_kwargs,
    configure_pad_token,
    handle_stop_sequences,
    has_bos_prefix,
    normalize_gen_kwargs,
    postprocess_generated_text,
    resolve_max_length,
)
from tqdm import tqdm

from compose.composed_lm import ComposedLM
from compose.decoding import check_compile
from compose.vocab import check_tokenizers

MODEL_NAME = "composed"
DEFAULT_MAX_LENGTH = 2048
GENERATION_KEYS = ("do_sample", "temperature", "top_k", "top_p", "max_length")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")

Request = tuple[tuple[str, str] | None, list[int], list[int]]


@register_model(MODEL_NAME)
class ComposedLMEval(TemplateLM):
    """lm-eval ``LM`` over a :class:`ComposedLM` (``model_args="manifest=EXPORT_DIR,..."``).

    Args:
        manifest: an export folder (see :func:`compose.export.export_composition`); or pass ``composed``.
        composition: ``"soft"`` or ``"gated"`` (experts act inside their ``interval`` only; the
            continuation of a request is what "is generated", so gates open on it, not on the context).
        backend: ``"adapters"`` (one PeftModel, one mixed batch) or ``"separate"`` (one model each).
        batch_size: requests (or rolling windows) per forward / generate call.
        max_length: context length in tokens (default: the background config's, as ``hf``).
        device: where the model runs (default ``cuda`` if available, else ``cpu``).
        dtype: optional weight dtype (``float32``, ``bfloat16``, ``float16``); composition is float32.
        max_gen_toks: default number of generated tokens when a task gives none (256, as ``hf``).
        add_bos_token, prefix_token_id, truncation, logits_cache, chat_template_args: as in ``hf``.
        composed: a ready :class:`ComposedLM` (with a tokenizer) instead of ``manifest``.
        packed_weights: on CPU, run each call's forwards on oneDNN-packed linear weights
            (:meth:`ComposedLM.packed_weights`, tuned for ``batch_size``): the same tokens and scores up to rounding,
            decoding faster where the CPU's kernels make a few rows cost about one; costs a copy of the weights.
        compile: ``generate_until`` decodes with ``ComposedLM.generate(compile=...)``: ``true`` or a
            ``torch.compile`` mode (``reduce-overhead``: CUDA graphs on a GPU). Each new batch size or 128-token
            cache length compiles once (minutes for SmolLM2-135M on a CPU); not with ``packed_weights``.
        max_batch_size: accepted for ``simple_evaluate``'s sake; unused (no ``auto`` batch size).
    """

    def __init__(
        self,
        manifest: str | os.PathLike | None = None,
        composition: str = "soft",
        backend: str = "adapters",
        batch_size: int | str = 1,
        max_length: int | None = None,
        device: str | None = None,
        dtype: str | None = None,
        max_gen_toks: int = 256,
        add_bos_token: bool | None = None,
        prefix_token_id: int | None = None,
        truncation: bool = False,
        logits_cache: bool = True,
        chat_template_args: dict[str, Any] | None = None,
        composed: ComposedLM | None = None,
        packed_weights: bool | str = False,
        compile: bool | str = False,
        max_batch_size: int | None = None,
        **unknown: Any,
    ) -> None:
        super().__init__()
        if unknown:
            raise ValueError(f"{MODEL_NAME}: unknown model_args {sorted(unknown)}")
        if (manifest is None) == (composed is None):
            raise ValueError(f"{MODEL_NAME}: pass exactly one of manifest=EXPORT_DIR or composed=ComposedLM")
        self._batch_size = _positive_int(batch_size, "batch_size")
        self._max_length = None if max_length is None else _positive_int(max_length, "max_length")
        self._max_gen_toks = _positive_int(max_gen_toks, "max_gen_toks")
        self.packed_weights = _flag(packed_weights, "packed_weights")
        try:
            self.compile = check_compile(compile, self.packed_weights)
        except (TypeError, ValueError) as err:
            raise ValueError(f"{MODEL_NAME}: {err}") from None
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if composed is None:
            check_export_tokenizer(manifest)
            composed = ComposedLM.from_manifest(manifest, backend=backend, device=device, composition=composition)
        else:
            composed.composition = composition
            composed.to(device)
        composed.lazy = True  # gated: an expert runs only while its interval is open (ignored when soft or compiled)
        if dtype not in (None, "auto"):
            from lm_eval.models.utils_hf import get_dtype

            composed.to(get_dtype(dtype))
        if composed.tokenizer is None:
            raise ValueError(f"{MODEL_NAME}: the ComposedLM has no tokenizer (an export always has one)")
        self.composed = composed.eval()
        self.manifest = None if manifest is None else str(manifest)
        self._device = composed.device
        self.tokenizer = configure_pad_token(composed.tokenizer)
        self.add_bos_token = add_bos_token
        self.custom_prefix_token_id = prefix_token_id
        self.truncation = bool(truncation)
        # A group of requests shares one row only when the composed log-probs cannot depend on where the
        # context ends, i.e. not under gating (the gates open on the continuation).
        self.logits_cache = bool(logits_cache) and composition != "gated"
        self.chat_template_args = dict(chat_template_args or {})

    # ------------------------------------------------------------------ properties (as HFLM)

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        if self.custom_prefix_token_id is not None:
            return self.custom_prefix_token_id
        if self.tokenizer.bos_token_id is not None:
            return self.tokenizer.bos_token_id
        return self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        if self._max_length:
            return self._max_length
        return resolve_max_length(_background_config(self.composed), self.tokenizer, default=DEFAULT_MAX_LENGTH)

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    # ------------------------------------------------------------------ tokenization (as HFLM)

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None, **kwargs
    ) -> list[int]:
        """Token ids of ``string``; special tokens as the tokenizer adds them, unless it starts with BOS."""
        special = _add_special_kwargs(add_special_tokens, self.add_bos_token)
        if add_special_tokens is None and has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            special["add_special_tokens"] = False
        encoding = self.tokenizer.encode(string, **special)
        return encoding[-left_truncate_len:] if left_truncate_len else encoding

    def tok_batch_encode(
        self, strings: list[str], left_truncate_len: int | None = None, truncation: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded ``(input_ids, attention_mask)`` of ``strings``, left-truncated to ``left_truncate_len``."""
        old_side = self.tokenizer.padding_side
        self.tokenizer.padding_side = "left"
        special: dict[str, bool] = {}
        if has_bos_prefix(strings[0], getattr(self.tokenizer, "bos_token", None)):
            special = {"add_special_tokens": False}
        elif self.add_bos_token is not None:
            special = {"add_special_tokens": self.add_bos_token}
        try:
            enc = self.tokenizer(strings, truncation=truncation, padding="longest", return_tensors="pt", **special)
        finally:
            self.tokenizer.padding_side = old_side
        ids, mask = enc["input_ids"], enc["attention_mask"]
        if left_truncate_len:
            ids, mask = ids[:, -left_truncate_len:], mask[:, -left_truncate_len:]
        return ids, mask

    def tok_decode(self, tokens: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------------ scoring

    def _composed_logprobs(self, inps: list[list[int]], prompt_lens: list[int]) -> torch.Tensor:
        """Composed log-probs ``[B, T, V]`` of right-padded rows (causal: padding never reaches a real token).

        Under gating, row ``i``'s gates run over its tokens from ``prompt_lens[i]`` on, as in ``generate``.
        """
        width = max(len(x) for x in inps)
        pad = self.tokenizer.pad_token_id or 0
        ids = torch.tensor([x + [pad] * (width - len(x)) for x in inps], dtype=torch.long, device=self.device)
        masks = None
        if self.composed.composition == "gated" and self.composed.num_experts:
            masks = torch.ones(self.composed.num_experts, len(inps), width, dtype=torch.bool)
            for row, (x, prompt_len) in enumerate(zip(inps, prompt_lens, strict=True)):
                masks[:, row, : len(x)] = self.composed.interval_masks(torch.tensor([x]), prompt_len)[:, 0].cpu()
        return self.composed.score(ids, masks=masks)

    def _loglikelihood_tokens(
        self, requests: list[Request], disable_tqdm: bool = False, override_bs: int | None = None
    ) -> list[tuple[float, bool]]:
        """``(sum of the continuation's composed log-probs, is it the greedy continuation)`` per request."""
        collator = Collator(
            requests,
            sort_fn=lambda req: (-len(req[1] + req[2]), tuple(req[1] + req[2])),
            group_by="contexts" if self.logits_cache else None,
            group_fn=lambda req: req[-2] + req[-1][:-1],
        )
        pbar = tqdm(total=len(requests), disable=disable_tqdm or self.rank != 0, desc="Running loglikelihood requests")
        with self._weights():
            results = self._loglikelihood_chunks(collator, override_bs or self.batch_size, pbar)
        pbar.close()
        return collator.get_original(results)

    def _loglikelihood_chunks(self, collator: Collator, batch_size: int, pbar) -> list[tuple[float, bool]]:
        """The answers of :meth:`_loglikelihood_tokens`, in the collator's order."""
        results = []
        for chunk in collator.get_batched(n=batch_size):
            inps, prompt_lens = [], []
            for _, context_enc, continuation_enc in chunk:
                if not context_enc or not continuation_enc:
                    raise ValueError(f"{MODEL_NAME}: empty context or continuation tokens")
                if len(continuation_enc) > self.max_length:
                    raise ValueError(f"{MODEL_NAME}: continuation of {len(continuation_enc)} tokens > max_length "
                                     f"{self.max_length}")
                window = (context_enc + continuation_enc)[-(self.max_length + 1):]
                inps.append(window[:-1])
                prompt_lens.append(len(window) - len(continuation_enc))
            logprobs = self._composed_logprobs(inps, prompt_lens)
            for (request_str, ctx_tokens, cont_enc), lp, inp in zip(chunk, logprobs, inps, strict=True):
                # cont_enc is the longest continuation of its group (the one the Collator kept)
                lp = lp[len(inp) - len(cont_enc) : len(inp)].unsqueeze(0)  # [1, contlen, V]
                greedy = lp.argmax(-1)
                for req_str, cont_toks, cont_lp in collator.get_cache(
                    req_str=request_str, cxt_toks=ctx_tokens, cont_toks=cont_enc, logits=lp
                ):
                    cont = torch.tensor(cont_toks, dtype=torch.long, device=cont_lp.device).unsqueeze(0)
                    is_greedy = bool((greedy[:, -cont.shape[1]:] == cont).all())
                    picked = torch.gather(cont_lp[:, -cont.shape[1]:], 2, cont.unsqueeze(-1)).squeeze(-1)
                    answer = (float(picked.sum()), is_greedy)
                    results.append(answer)
                    if req_str is not None:
                        self.cache_hook.add_partial("loglikelihood", req_str, answer)
                    pbar.update(1)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of each whole string: lm-eval's disjoint rolling windows of ``max_length`` tokens."""
        windows: list[tuple[int, Request]] = []
        for index, (string,) in enumerate(tqdm([r.args for r in requests], disable=disable_tqdm or self.rank != 0)):
            rolling = lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1,
            )
            windows += [(index, (None, *lm_utils.make_disjoint_window(w))) for w in rolling]
        totals = [0.0] * len(requests)
        with self._weights():  # once for all windows (the calls below then find the layers packed)
            for start in range(0, len(windows), self.batch_size):
                batch = windows[start : start + self.batch_size]
                scores = self._loglikelihood_tokens([w for _, w in batch], disable_tqdm=True, override_bs=len(batch))
                for (index, _), (logprob, _) in zip(batch, scores, strict=True):
                    totals[index] += logprob
        for request, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    # ------------------------------------------------------------------ generation

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled) continuations, stopped at ``until`` and EOS, cut at the first stop string."""
        results = []
        collator = Collator(
            [r.args for r in requests],
            sort_fn=lambda req: (-len(self.tok_encode(req[0])), req[0]),
            group_by="gen_kwargs",
            group_fn=lambda req: req[1],
        )
        pbar = tqdm(total=len(requests), disable=disable_tqdm or self.rank != 0, desc="Running generate_until requests")
        eos = self.tok_decode(self.eot_token_id, skip_special_tokens=False)
        with self._weights():
            for chunk in collator.get_batched(n=self.batch_size):
                contexts, all_gen_kwargs = zip(*chunk, strict=True)
                gen_kwargs = all_gen_kwargs[0]
                for context, text in zip(contexts, self._generate_batch(list(contexts), gen_kwargs, eos), strict=True):
                    results.append(text)
                    self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
                    pbar.update(1)
        pbar.close()
        return collator.get_original(results)

    def _weights(self) -> contextlib.AbstractContextManager:
        """The weights one call runs on: oneDNN-packed with ``packed_weights`` (a no-op where already packed)."""
        return self.composed.packed_weights(self.batch_size) if self.packed_weights else contextlib.nullcontext()

    def _generate_batch(self, contexts: list[str], gen_kwargs: dict, eos: str) -> list[str]:
        if not isinstance(gen_kwargs, dict):
            raise ValueError(f"{MODEL_NAME}: generation kwargs must be a dict, got {type(gen_kwargs).__name__}")
        kwargs = dict(normalize_gen_kwargs(gen_kwargs, self.max_gen_toks))
        until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
        max_gen_toks = kwargs.pop("max_gen_toks")
        unsupported = sorted(set(kwargs) - set(GENERATION_KEYS))
        if unsupported:
            raise ValueError(f"{MODEL_NAME}: unsupported generation kwargs {unsupported} (supported: "
                             f"until, max_gen_toks, {', '.join(GENERATION_KEYS)})")
        max_ctx_len = self.max_length - max_gen_toks
        if max_ctx_len <= 0:
            raise ValueError(f"{MODEL_NAME}: max_gen_toks {max_gen_toks} must be below max_length {self.max_length}")
        ids, mask = self.tok_batch_encode(contexts, left_truncate_len=max_ctx_len, truncation=self.truncation)
        max_new = int(kwargs.pop("max_length", ids.shape[1] + max_gen_toks)) - ids.shape[1]
        do_sample = bool(kwargs.get("do_sample", False))
        out = self.composed.generate(
            ids.to(self.device), mask.to(self.device),
            max_new_tokens=max_new,
            do_sample=do_sample,
            temperature=float(kwargs.get("temperature") or 1.0) if do_sample else 1.0,
            top_k=kwargs.get("top_k"),
            top_p=kwargs.get("top_p"),
            eos_token_id=_eos_ids(self.composed, self.tokenizer),
            pad_token_id=self.tokenizer.pad_token_id,
            stop_strings=until,
            tokenizer=self.tokenizer,
            compile=self.compile,
        )
        return [postprocess_generated_text(self.tok_decode(row[ids.shape[1]:]), until, None) for row in out.tolist()]

    # ------------------------------------------------------------------ chat templates, info

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The tokenizer's chat template over ``chat_history`` (dropping system turns if it refuses them)."""
        import jinja2

        kwargs = dict(tokenize=False, add_generation_prompt=add_generation_prompt,
                      continue_final_message=not add_generation_prompt, **self.chat_template_args)
        try:
            return self.tokenizer.apply_chat_template(chat_history, **kwargs)
        except jinja2.exceptions.TemplateError:
            history = [m for m in chat_history if m["role"] != "system"]
            return self.tokenizer.apply_chat_template(history, **kwargs)

    def get_model_info(self) -> dict:
        """What ``simple_evaluate`` records under ``config`` (no network: nothing is looked up on the hub)."""
        return {
            "manifest": self.manifest,
            "experts": list(self.composed.names),
            "weights": list(self.composed.weights),
            "composition": self.composed.composition,
            "backend": self.composed.backend,
            "compile": self.compile,
            "model_num_parameters": sum(p.numel() for p in self.composed.parameters()),
            "model_dtype": str(next(self.composed.parameters()).dtype),
        }


# ---------------------------------------------------------------------- helpers


def _positive_int(value: int | str, key: str) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{MODEL_NAME}: {key} must be a positive integer, got {value!r}") from None
    if number <= 0:
        raise ValueError(f"{MODEL_NAME}: {key} must be a positive integer, got {value!r}")
    return number


def _flag(value: bool | str, key: str) -> bool:
    """A boolean model_arg: a bool, or ``true``/``false`` (any case) as lm-eval's argument strings give it."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text not in ("true", "false"):
        raise ValueError(f"{MODEL_NAME}: {key} must be true or false, got {value!r}")
    return text == "true"


def _background_config(composed: ComposedLM):
    model = composed.model.get_base_model() if composed.backend == "adapters" else composed.background
    return model.config


def _eos_ids(composed: ComposedLM, tokenizer) -> int | list[int] | None:
    """The ids HF ``generate`` stops at: the generation config's EOS, else the tokenizer's."""
    model = composed.model.get_base_model() if composed.backend == "adapters" else composed.background
    gen_config = getattr(model, "generation_config", None)
    eos = None if gen_config is None else gen_config.eos_token_id
    return tokenizer.eos_token_id if eos is None else eos


def check_export_tokenizer(path: str | os.PathLike) -> None:
    """Refuse an export whose tokenizer differs from one saved beside its background (if any is there).

    Raises:
        ValueError: one line naming both folders and what differs.
    """
    from compose.export import export_root, load_manifest, resolve_ref
    from compose.model_io import load_tokenizer

    root = export_root(path)
    manifest = load_manifest(root)
    background = manifest["background"]
    bg_dir = root / background["path"] if "path" in background else resolve_ref(root, background["ref"])
    if not any((bg_dir / name).is_file() for name in _TOKENIZER_FILES):
        return
    export_dir = root / manifest["tokenizer"]
    try:
        check_tokenizers([load_tokenizer(bg_dir), load_tokenizer(export_dir)],
                         ["background", f"export tokenizer {export_dir}"])
    except ValueError as err:
        raise ValueError(f"{root}: the tokenizer differs from the background's ({bg_dir}): {err}") from None


# ---------------------------------------------------------------------- command line


def resolve_tasks(tasks: Sequence[str], include_path: str | None, include_defaults: bool = True):
    """``(task names, TaskManager)`` for ``tasks`` (names or glob patterns, or YAML files).

    Plain tasks found under ``include_path`` are loaded from there alone (indexing lm-eval's ~15k
    built-in tasks takes half a minute); anything else also searches lm-eval's own tasks, unless
    ``include_defaults`` is False.

    Raises:
        ValueError: one line naming every task that exists nowhere.
    """
    from lm_eval.tasks import TaskManager
    from lm_eval.tasks._index import Kind

    if include_path is not None and not Path(include_path).exists():
        raise ValueError(f"--include_path {include_path}: no such folder")
    if include_path is not None:
        local = TaskManager(include_path=include_path, include_defaults=False)
        names = _match(local, tasks)
        if names is not None and (not include_defaults or all(
            local.task_index[n].kind in (Kind.TASK, Kind.PY_TASK) for n in names if n in local.task_index
        )):
            return names, local
    manager = TaskManager(include_path=include_path, include_defaults=include_defaults)
    names = _match(manager, tasks)
    if names is None:
        missing = [t for t in tasks if not manager.match_tasks([t]) and not Path(t).is_file()]
        where = " or ".join((["lm-eval's tasks"] if include_defaults else []) + ([include_path] if include_path else []))
        raise ValueError(f"unknown lm-eval task(s) {', '.join(missing)} (not in {where or 'any task folder'})")
    return names, manager


def _match(manager, tasks: Sequence[str]) -> list[str] | None:
    """Task names matching ``tasks`` in order (globs expanded), or None if one matches nothing."""
    names: list[str] = []
    for task in tasks:
        found = [task] if Path(task).is_file() else manager.match_tasks([task])
        if not found:
            return None
        names += [n for n in found if n not in names]
    return names


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m compose.lm_eval", description=__doc__.split("\n")[0])
    p.add_argument("--manifest", required=True, help="export folder (composition.yaml)")
    p.add_argument("--tasks", required=True, help="comma-separated task names, glob patterns or YAML files")
    p.add_argument("--include_path", default=None, help="folder of extra task YAMLs")
    p.add_argument("--no_default_tasks", action="store_true",
                   help="index only --include_path, not lm-eval's built-in tasks (faster)")
    p.add_argument("--limit", type=float, default=None, help="at most this many examples per task (<1: a fraction)")
    p.add_argument("--batch_size", type=int, default=1)
    p.add_argument("--composition", choices=("soft", "gated"), default="soft")
    p.add_argument("--backend", choices=("adapters", "separate"), default="adapters")
    p.add_argument("--device", default=None)
    p.add_argument("--max_length", type=int, default=None)
    p.add_argument("--packed_weights", action="store_true",
                   help="CPU: run on oneDNN-packed linear weights (model_arg packed_weights; ComposedLM.packed_weights)")
    p.add_argument("--compile", nargs="?", const="true", default=None, metavar="MODE",
                   help="decode generate_until requests with torch.compile (model_arg compile; optional mode, e.g. "
                        "reduce-overhead for CUDA graphs)")
    p.add_argument("--num_fewshot", type=int, default=None)
    p.add_argument("--apply_chat_template", action="store_true")
    p.add_argument("--log_samples", action="store_true", help="keep per-sample outputs in --output")
    p.add_argument("--seed", type=int, default=1234, help="python/numpy/torch/fewshot seed")
    p.add_argument("--output", default=None, help="write the results as JSON to this file")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Evaluate an export on lm-eval tasks; print the table, write ``--output``. Exit 2 on bad input."""
    from lm_eval import simple_evaluate

    args = _parser().parse_args(argv)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    try:
        if not tasks:
            raise ValueError("--tasks is empty")
        names, manager = resolve_tasks(tasks, args.include_path, include_defaults=not args.no_default_tasks)
        model_args = {"manifest": args.manifest, "composition": args.composition, "backend": args.backend,
                      "batch_size": args.batch_size}
        if args.device:
            model_args["device"] = args.device
        if args.max_length:
            model_args["max_length"] = args.max_length
        if args.packed_weights:
            model_args["packed_weights"] = True
        if args.compile:
            model_args["compile"] = args.compile
        lm = ComposedLMEval(**model_args)
    except (ValueError, FileNotFoundError) as err:
        print(f"compose.lm_eval: error: {err}", file=sys.stderr)
        return 2
    limit = None if args.limit is None else (int(args.limit) if args.limit >= 1 else args.limit)
    results = simple_evaluate(
        model=lm, tasks=names, task_manager=manager, limit=limit, num_fewshot=args.num_fewshot,
        apply_chat_template=args.apply_chat_template, log_samples=args.log_samples,
        random_seed=args.seed, numpy_random_seed=args.seed, torch_random_seed=args.seed, fewshot_random_seed=args.seed,
    )
    results["config"]["model"] = MODEL_NAME
    results["config"]["model_args"] = model_args
    print(lm_utils.make_table(results))
    if args.output:
        out = Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".{out.name}.tmp")
        tmp.write_text(json.dumps(results, indent=2, default=lm_utils.handle_non_serializable, ensure_ascii=False))
        tmp.replace(out)
        print(f"results written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
