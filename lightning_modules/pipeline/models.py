"""Building the background causal LM: from scratch (a tiny config) or from a local HF folder."""

from __future__ import annotations

from pathlib import Path

from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from compose.common import check_vocab
from lightning_modules.pipeline.config import ConfigError, ModelConfig


def build_causal_lm(cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
    """A causal LM for `tokenizer`'s vocabulary; `cfg.pretrained_path` loads local weights instead."""
    special = dict(pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                   eos_token_id=tokenizer.eos_token_id)
    if cfg.pretrained_path:
        return load_pretrained(cfg.pretrained_path, tokenizer, trust_remote_code=cfg.trust_remote_code)
    if cfg.arch == "llama":
        config = LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
            num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
            num_key_value_heads=cfg.num_heads, max_position_embeddings=cfg.max_position_embeddings,
            tie_word_embeddings=False, **special,
        )
    else:  # gpt2 (the authors' toy set-up)
        config = GPT2Config(
            vocab_size=len(tokenizer), n_embd=cfg.hidden_size, n_layer=cfg.num_layers, n_head=cfg.num_heads,
            n_inner=cfg.intermediate_size, n_positions=cfg.max_position_embeddings,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **special,
        )
    return AutoModelForCausalLM.from_config(config)


def load_pretrained(path: str | Path, tokenizer: PreTrainedTokenizerBase | None = None,
                    trust_remote_code: bool = False, where: str = "model") -> PreTrainedModel:
    """Load a local HF causal LM (safetensors only); refuse one whose vocabulary cannot hold the tokenizer's
    (a larger embedding table, as pretrained checkpoints pad theirs, is fine)."""
    p = Path(path)
    if not (p / "config.json").is_file():
        raise ConfigError(f"{where}: no HF model folder at {path} (config.json missing)")
    try:
        model = AutoModelForCausalLM.from_pretrained(p, use_safetensors=True, trust_remote_code=trust_remote_code)
    except Exception as e:
        raise ConfigError(f"{where}: cannot load model from {path}: {str(e).splitlines()[0]}") from None
    try:
        check_vocab(tokenizer, model.get_output_embeddings().weight.shape[0], f"{where}={path}")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return model


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())
