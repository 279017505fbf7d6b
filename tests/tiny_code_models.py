"""Tiny stand-ins for code models, built in-process: a byte-level BPE tokenizer over ASCII
(adds BOS like Llama's and Gemma's, has a chat template), random Llama models and LoRA experts on it, and
HumanEval-style problems. Shared by the code-generation and the Gemma-2 dry-run tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tiny_models import random_lora
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

PAD, BOS, EOS = 0, 1, 2
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
PROBLEMS = [
    {"task_id": "Tiny/0", "entry_point": "add",
     "prompt": 'def add(a, b):\n    """Return a + b.\n    >>> add(1, 2)\n    3\n    """\n',
     "canonical_solution": "    return a + b\n",
     "test": "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(-1, 1) == 0\n"},
    {"task_id": "Tiny/1", "entry_point": "first",
     "prompt": 'from typing import List\n\n\ndef first(xs: List[int]) -> int:\n    """The first item."""\n',
     "canonical_solution": "    return xs[0]\n",
     "test": "def check(candidate):\n    assert candidate([4, 5]) == 4\n"},
    {"task_id": "Tiny/2", "entry_point": "is_even",
     "prompt": "def is_even(n):\n    # True when n is even\n",
     "canonical_solution": "    return n % 2 == 0\n",
     "test": "def check(candidate):\n    assert candidate(2) and not candidate(3)\n"},
]
CORPUS = [p["prompt"] + p["canonical_solution"] for p in PROBLEMS] + [
    "Question: Tom has 3 apples and buys 4 more. How many apples?\nAnswer: 3 + 4 = 7. #### 7\n",
    "Problem: What is $2+2$?\nSolution: $2+2=4$. Final Answer: The final answer is $4$.\n",
    "def main():\n    print('hello')\n\nif __name__ == '__main__':\n    main()\n",
]


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character map, the alphabet of a ByteLevel BPE."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), 256)]
    chars, extra = dict(zip(keep, map(chr, keep), strict=True)), 0
    for b in range(256):
        if b not in chars:
            chars[b], extra = chr(256 + extra), extra + 1
    return chars


def code_tokenizer(vocab_size: int = 200) -> PreTrainedTokenizerFast:
    """A byte-level BPE over the 128 ASCII bytes (every ASCII text encodes, and whatever a random model
    generates decodes to ASCII) that adds BOS and has a chat template."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    ascii_alphabet = [_byte_chars()[b] for b in range(128)]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<bos>", "<eos>"],
                                  initial_alphabet=ascii_alphabet, show_progress=False)
    tok.train_from_iterator(CORPUS * 5, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", BOS)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                   clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def llama_config(vocab: int) -> LlamaConfig:
    return LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)


def tiny_llama(vocab: int, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config(vocab)).eval()


def tiny_lora(vocab: int, names=("a", "b"), seed: int = 0):
    """A PeftModel on ``tiny_llama(vocab, seed)`` with LoRA adapters whose B matrices are random."""
    return random_lora(tiny_llama(vocab, seed), names, seed, scale=0.5)


def write_problems(path: Path, problems=PROBLEMS) -> Path:
    path.write_text("".join(json.dumps(p) + "\n" for p in problems))
    return path
