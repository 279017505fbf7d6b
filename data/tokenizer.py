"""Tokenizers: a character-level one for the synthetic tasks, and loading a user's tokenizer folder.

`load_tokenizer_folder(path, where=...)` is how a tokenizer named by a user (a config key) is loaded: a folder
that is missing, empty, unreadable or holds no tokenizer files is one line naming it, before transformers sees it.

One token per character. The vocabulary is the five special tokens, then the alphabet in order::

    <pad>=0  <bos>=1  <eos>=2  <sep>=3  <unk>=4  alphabet[0]=5  alphabet[1]=6  ...

The tokenizer adds no special tokens by itself (no post-processor): sequences such as
``<bos> x <sep> y <eos>`` are assembled by the tasks (:mod:`data.tasks.letters`). It saves with
``save_pretrained`` and loads back with ``AutoTokenizer.from_pretrained(folder)`` offline, with identical
vocabulary and behaviour.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from data.rows import one_line, quiet_loggers

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


# --- a user's tokenizer folder ---------------------------------------------------------------------
# Files any of which makes a folder a tokenizer folder (fast, SentencePiece, BPE, WordPiece tokenizers).
TOKENIZER_FILES: tuple[str, ...] = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "spiece.model",
                                    "sentencepiece.bpe.model", "vocab.json", "vocab.txt")
# A hub repository id (`name` or `owner/name`), tried on the hub (or its local cache) when no such folder exists.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


class TokenizerFolderError(ValueError):
    """A tokenizer folder that cannot be loaded: one line naming it (and the config key that gave it)."""


def load_tokenizer_folder(path: str | os.PathLike, where: str = "tokenizer",
                          trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """The tokenizer saved in the folder `path` (`AutoTokenizer.from_pretrained`), or of the hub repository `path`
    where no such folder exists and the name is a repository id.

    Args:
        path: a tokenizer folder, or a hub repository id.
        where: what named it, first in every error (a config key such as `task.tokenizer`).
        trust_remote_code: passed to `AutoTokenizer.from_pretrained`.

    Raises:
        TokenizerFolderError: one line: `tokenizer folder not found: X`, `tokenizer folder X is empty`,
            `X is not a tokenizer folder (...)`, `X is a file, not a tokenizer folder`, or the loader's own error.
    """
    from transformers import AutoTokenizer

    prefix = f"{where}: " if where else ""
    folder = Path(path)
    if not os.path.lexists(folder):
        if not _HUB_ID.fullmatch(str(path)):
            raise TokenizerFolderError(f"{prefix}tokenizer folder not found: {path}")
        try:
            with quiet_loggers("huggingface_hub"):  # no retry lines when offline
                return AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
        except Exception as err:  # noqa: BLE001 - any loader error becomes one line naming it
            raise TokenizerFolderError(f"{prefix}tokenizer folder not found: {path} (nor a hub tokenizer of that "
                                       f"name: {one_line(err, 200)})") from None
    try:
        names = sorted(entry.name for entry in folder.iterdir())
    except NotADirectoryError:
        raise TokenizerFolderError(f"{prefix}{path} is a file, not a tokenizer folder") from None
    except PermissionError:
        raise TokenizerFolderError(f"{prefix}tokenizer folder {path} cannot be read by this user "
                                   "(permission denied)") from None
    except OSError as err:  # a symbolic link loop or a dangling link
        raise TokenizerFolderError(f"{prefix}tokenizer folder not found: {path} ({err.strerror})") from None
    if not names:
        raise TokenizerFolderError(f"{prefix}tokenizer folder {path} is empty")
    if not set(names) & set(TOKENIZER_FILES):
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        raise TokenizerFolderError(f"{prefix}{path} is not a tokenizer folder (no {' / '.join(TOKENIZER_FILES[:3])}"
                                   f" / ... in it; it holds {shown})")
    try:
        return AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except Exception as err:  # noqa: BLE001 - any loader error becomes one line naming the folder
        vocabularies = [name for name in TOKENIZER_FILES if name != "tokenizer_config.json"]
        if not set(names) & set(vocabularies):
            raise TokenizerFolderError(f"{prefix}tokenizer folder {path} has a tokenizer_config.json but no vocabulary "
                                       f"the tokenizer can load ({', '.join(vocabularies)})") from None
        raise TokenizerFolderError(f"{prefix}tokenizer folder {path}: cannot load the tokenizer in it: "
                                   f"{one_line(err, 200)}") from None
