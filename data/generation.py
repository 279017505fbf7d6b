"""Greedy decoding of prompts with a (composed) model, shared by every task's evaluation. No Lightning here."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import LongTensor, Tensor
from transformers import PreTrainedTokenizerBase


def left_padded(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[LongTensor, LongTensor]:
    """Prompt ids LEFT-padded with `pad_id`: `(input_ids, attention_mask)`, both `[B, max len]`."""
    if not prompts:
        raise ValueError("left_padded got no prompts")
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for b, ids in enumerate(prompts):
        if len(ids):
            input_ids[b, width - len(ids):] = torch.as_tensor(list(ids), dtype=torch.long)
            attention_mask[b, width - len(ids):] = 1
    return input_ids, attention_mask


def decode_until_eos(tokenizer: PreTrainedTokenizerBase, generated: Tensor, prompt_len: int,
                     eos: int) -> list[tuple[str, bool]]:
    """`(text, ended_with_eos)` per row of `generated` `[B, prompt_len + n]`: the tokens after the prompt up
    to the first EOS (exclusive), decoded with special tokens kept (a stray `<sep>` never matches text)."""
    if generated.dim() != 2 or not 0 <= prompt_len <= generated.shape[1]:
        raise ValueError(f"generated must be [B, T] with T >= prompt_len={prompt_len}, got {tuple(generated.shape)}")
    out = []
    for row in generated[:, prompt_len:].tolist():
        ended = eos in row
        ids = row[: row.index(eos)] if ended else row
        out.append((tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False), ended))
    return out


@torch.no_grad()
def greedy_decode(model, tokenizer: PreTrainedTokenizerBase, prompts: Sequence[Sequence[int]], batch_size: int,
                  max_new_tokens: int | Callable[[Sequence[Sequence[int]]], int],
                  stop_strings: Sequence[str] = ()) -> tuple[list[str], list[bool]]:
    """Greedy outputs of `model.generate` (a `ComposedLM`) for prompt ids, up to EOS, and whether each ended.

    Args:
        prompts: token ids per prompt (left-padded here, in batches of `batch_size`).
        max_new_tokens: a budget, or a function of each batch's prompts giving one.
        stop_strings: an output also ends before the first of these (a base model, which ends a line of its
            prompt's pattern rather than emitting EOS).
    """
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    pad = eos if pad is None else pad
    device = getattr(model, "device", torch.device("cpu"))
    texts, ended = [], []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        ids, attn = left_padded(chunk, pad)
        budget = max_new_tokens(chunk) if callable(max_new_tokens) else max_new_tokens
        stop = {"stop_strings": list(stop_strings), "tokenizer": tokenizer} if stop_strings else {}
        out = model.generate(ids.to(device), attn.to(device), max_new_tokens=budget, do_sample=False,
                             eos_token_id=eos, pad_token_id=pad, **stop)
        for text, done in decode_until_eos(tokenizer, out.cpu(), ids.shape[1], eos):
            cut = min((i for i in (text.find(s) for s in stop_strings) if i >= 0), default=None)
            texts.append(text if cut is None else text[:cut])
            ended.append(done or cut is not None)
    return texts, ended
