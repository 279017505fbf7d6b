"""Tiny models, adapters and a character tokenizer built in-process, shared by the compose tests."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from peft import LoraConfig, get_peft_model
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

VOCAB = 32
EOS, PAD = 2, 0

needs_cpp_compiler = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None,
                                        reason="torch.compile on CPU (inductor) needs a C++ compiler")


def char_tokenizer(letters: str = "ABCDEFGHIJKLMNOPQRSTUVWXYZ") -> PreTrainedTokenizerFast:
    specials = ["<pad>", "<bos>", "<eos>", "<sep>", "<unk>"]
    vocab = {t: i for i, t in enumerate(specials + list(letters))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
        sep_token="<sep>", unk_token="<unk>",
    )


def tiny_model(arch: str = "llama", seed: int = 0, vocab: int = VOCAB):
    torch.manual_seed(seed)
    if arch == "llama":
        config = LlamaConfig(
            vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            bos_token_id=1, eos_token_id=EOS, pad_token_id=PAD,
        )
        return LlamaForCausalLM(config).eval()
    config = GPT2Config(
        vocab_size=vocab, n_embd=32, n_layer=2, n_head=4, n_positions=64,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=EOS, pad_token_id=PAD,
    )
    return GPT2LMHeadModel(config).eval()


def random_lora(model, names=("a", "b"), seed: int = 0, scale: float = 0.3):
    """`model` under LoRA adapters `names` whose B matrices are random (so experts really differ)."""
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)
    peft_model = get_peft_model(model, config, adapter_name=names[0])
    for name in names[1:]:
        peft_model.add_adapter(name, config)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for pname, p in peft_model.named_parameters():
            if "lora_B" in pname:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
    return peft_model.eval()


def tiny_peft(arch: str = "llama", names=("a", "b"), seed: int = 0):
    """A PeftModel on `tiny_model(arch, seed)` with random LoRA adapters `names`."""
    return random_lora(tiny_model(arch, seed), names, seed)


# One adapter per entry: (rank, alpha, targets); experts differ in rank and in the layers they adapt.
_ADAPTERS = [(4, 8, "all-linear"), (2, 4, ["q_proj", "v_proj"]), (3, 3, ["gate_proj", "down_proj", "k_proj"])]


def mixed_lora_model(k: int = 3):
    """A peft Llama with `k` LoRA adapters `e0..` of different ranks, scalings and target modules (one adapts no
    MLP layer), their B matrices random so no adapter is a no-op."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=24, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    loras = [LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0)
             for r, alpha, targets in _ADAPTERS[:k]]
    return lora_experts(LlamaForCausalLM(cfg), loras)


def lora_experts(base, loras, generator: torch.Generator | None = None):
    """`base` (a transformers causal LM) with one LoRA adapter `e0, e1, …` per config of `loras`, their B matrices
    random (std 0.3, from `generator` or torch's global one) so no adapter is a no-op; in eval mode."""
    model = get_peft_model(base.eval(), loras[0], adapter_name="e0")
    for i, lora in enumerate(loras[1:], start=1):
        model.add_adapter(f"e{i}", lora)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    return model.eval()
