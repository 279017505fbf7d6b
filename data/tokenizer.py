"""A character-level tokenizer for the synthetic tasks, as a real Hugging Face fast tokenizer.

One token per character. The vocabulary is the five special tokens, then the alphabet in order::

    <pad>=0  <bos>=1  <eos>=2  <sep>=3  <unk>=4  alphabet[0]=5  alphabet[1]=6  ...

The tokenizer adds no special tokens by itself (no post-processor): sequences such as
``<bos> x <sep> y <eos>`` are assembled by the tasks (:mod:`data.tasks.letters`). It saves with
``save_pretrained`` and loads back with ``AutoTokenizer.from_pretrained(folder)`` offline, with identical
vocabulary and behaviour.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, SEP_TOKEN, UNK_TOKEN = "<pad>", "<bos>", "<eos>", "<sep>", "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, SEP_TOKEN, UNK_TOKEN)
DEFAULT_ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"

# Characters that could spell a special token (``<pad>``) inside a string, or that a tokenizer would
# treat ambiguously (whitespace): not allowed as letters.
_FORBIDDEN = set("<>")


def validate_alphabet(alphabet: str) -> None:
    """Raise ``ValueError`` unless ``alphabet`` is a non-empty string of unique single characters that
    cannot clash with the special tokens (no ``<``, ``>`` or whitespace)."""
    if not isinstance(alphabet, str) or not alphabet:
        raise ValueError(f"alphabet must be a non-empty string, got {alphabet!r}")
    seen: set[str] = set()
    for ch in alphabet:
        if ch in seen:
            raise ValueError(f"alphabet {alphabet!r} repeats the character {ch!r}")
        if ch in _FORBIDDEN or ch.isspace():
            raise ValueError(
                f"alphabet {alphabet!r} contains {ch!r}, which clashes with the special tokens "
                f"{list(SPECIAL_TOKENS)} (no '<', '>' or whitespace allowed)"
            )
        seen.add(ch)


def build_char_tokenizer(alphabet: str = DEFAULT_ALPHABET) -> PreTrainedTokenizerFast:
    """Build a one-token-per-character fast tokenizer over ``alphabet``.

    Args:
        alphabet: the letters, in vocabulary order (ids ``5, 6, ...``). Unique single characters, no
            ``<``, ``>`` or whitespace.

    Returns:
        A ``PreTrainedTokenizerFast`` with ``pad/bos/eos/sep/unk`` tokens set, right padding, and a
        decoder that joins characters without spaces (``decode(encode("ABC")) == "ABC"``). Characters
        outside the alphabet encode to ``<unk>``.
    """
    validate_alphabet(alphabet)
    vocab = {tok: i for i, tok in enumerate((*SPECIAL_TOKENS, *alphabet))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        sep_token=SEP_TOKEN,
        unk_token=UNK_TOKEN,
        padding_side="right",
        clean_up_tokenization_spaces=False,
    )


def letter_ids(tokenizer: PreTrainedTokenizerBase, alphabet: str | Sequence[str]) -> list[int]:
    """Token ids of the letters of ``alphabet``, in order.

    Raises:
        ValueError: if a letter is not a single token of ``tokenizer``'s vocabulary.
    """
    vocab = tokenizer.get_vocab()
    ids = []
    for ch in alphabet:
        if ch not in vocab:
            raise ValueError(f"letter {ch!r} is not in the tokenizer's vocabulary (size {len(vocab)})")
        ids.append(vocab[ch])
    return ids
