"""Do components share one vocabulary? Checks of models' vocabulary sizes and of tokenizers, before any forward."""

from __future__ import annotations

from typing import Any

from torch import nn


def check_vocab(tokenizer, vocab_size: int | None, where: str) -> None:
    """Refuse a model whose vocabulary cannot hold every token of `tokenizer`.

    A larger embedding table is fine: pretrained checkpoints pad theirs (to a multiple of 64, say).
    """
    if tokenizer is not None and vocab_size is not None and len(tokenizer) > vocab_size:
        raise ValueError(f"{where}: the model's vocabulary has {vocab_size} tokens, fewer than the tokenizer's "
                         f"{len(tokenizer)}")


def vocab_sizes(model: nn.Module) -> tuple[int | None, int | None]:
    """``(config vocab size, output dimension)`` of a causal LM (None where unknown)."""
    config = getattr(model, "config", None)
    config_vocab = None
    if config is not None:
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        config_vocab = getattr(text_config, "vocab_size", None)
    out_dim = None
    get_out = getattr(model, "get_output_embeddings", None)
    head = get_out() if callable(get_out) else None
    if head is not None:
        weight = getattr(head, "weight", None)
        out_dim = getattr(head, "out_features", None) or (None if weight is None else weight.shape[0])
    return config_vocab, out_dim


def check_same_vocab(components: list[tuple[str, nn.Module]]) -> None:
    """Refuse components (``(label, model)``, background first) whose vocabulary size (config or output
    dimension) differs from the background's."""
    _, background = components[0]
    bg_config, bg_out = vocab_sizes(background)
    if bg_config is not None and bg_out is not None and bg_config != bg_out:
        raise ValueError(f"background: config.vocab_size={bg_config} but its output layer has {bg_out} rows")
    bg = bg_out if bg_out is not None else bg_config
    for label, model in components[1:]:
        config_vocab, out_dim = vocab_sizes(model)
        for what, size in (("config.vocab_size", config_vocab), ("output dimension", out_dim)):
            if size is not None and bg is not None and size != bg:
                raise ValueError(
                    f"{label} has {what} {size} but the background's vocabulary size is {bg}; "
                    "composed components must share one vocabulary"
                )


def tokenizer_signature(tokenizer) -> tuple[dict[str, int], dict[str, Any]]:
    """``(vocabulary, special tokens)`` of a tokenizer: two tokenizers with equal signatures encode alike."""
    special = {}
    for attr in ("bos_token", "eos_token", "pad_token", "unk_token", "sep_token", "cls_token", "mask_token"):
        special[attr] = getattr(tokenizer, attr, None)
    special["all_special_ids"] = sorted(getattr(tokenizer, "all_special_ids", []) or [])
    return tokenizer.get_vocab(), special


def check_tokenizers(tokenizer, labels: list[str]):
    """One tokenizer, or one per component (``labels``, background first) that must all be identical (None
    entries are skipped); returns the background's.

    Raises:
        ValueError: a count that differs from ``labels``, or a tokenizer whose vocabulary or special tokens
            differ from the background's, naming the component.
    """
    if tokenizer is None or not isinstance(tokenizer, (list, tuple)):
        return tokenizer
    if len(tokenizer) != len(labels):
        raise ValueError(f"got {len(tokenizer)} tokenizers for {len(labels)} components (background + experts)")
    ref_vocab, ref_special = tokenizer_signature(tokenizer[0])
    for label, tok in zip(labels[1:], tokenizer[1:], strict=True):
        if tok is None:
            continue
        vocab, special = tokenizer_signature(tok)
        if vocab != ref_vocab:
            raise ValueError(
                f"{label} has a different tokenizer vocabulary than the background "
                f"({len(vocab)} vs {len(ref_vocab)} tokens, {len(set(vocab.items()) ^ set(ref_vocab.items()))} differ)"
            )
        if special != ref_special:
            diff = {k: (special[k], ref_special[k]) for k in special if special[k] != ref_special[k]}
            raise ValueError(f"{label} has different special tokens than the background: {diff}")
    return tokenizer[0]
