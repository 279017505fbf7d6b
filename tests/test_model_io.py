"""Model loading in one place: dtype names, the file checksum, HF folders, and the model-name registries."""

from __future__ import annotations

import hashlib

import pytest
import torch
from tiny_models import tiny_model

from compose.model_io import DTYPE_NAMES, pretrained_causal_lm, sha256_file, torch_dtype
from lightning_modules.pipeline.config import ConfigError, ModelConfig
from lightning_modules.pipeline.models import (
    ARCHITECTURE_NAMES,
    PRETRAINED,
    PRETRAINED_NAMES,
    architecture_config,
    file_sha256,
    load_pretrained,
)


def test_dtype_names_and_an_unknown_one():
    assert DTYPE_NAMES == ("auto", "float32", "bfloat16", "float16")
    assert torch_dtype("bfloat16") is torch.bfloat16 and torch_dtype(torch.float16) is torch.float16
    with pytest.raises(ValueError, match=r"dtype must be one of \('auto', 'float32', 'bfloat16', 'float16'\), "
                                         r"got 'float64'"):
        torch_dtype("float64")


def test_sha256_of_a_file_and_its_cached_twin(tmp_path):
    file = tmp_path / "blob"
    file.write_bytes(bytes(range(256)) * 9000)  # over one read block
    expected = hashlib.sha256(file.read_bytes()).hexdigest()
    assert sha256_file(file) == expected == file_sha256(file)


def test_pretrained_causal_lm_reads_safetensors_in_eval_mode(tmp_path):
    tiny_model("llama").save_pretrained(tmp_path / "m")
    model = pretrained_causal_lm(tmp_path / "m", dtype="bfloat16")
    assert not model.training and next(model.parameters()).dtype == torch.bfloat16
    (tmp_path / "m" / "model.safetensors").unlink()
    with pytest.raises(OSError):  # no safetensors: never falls back to a pickle
        pretrained_causal_lm(tmp_path / "m")


def test_model_names_and_architectures_come_from_their_registries():
    assert PRETRAINED_NAMES == tuple(PRETRAINED) and {"smollm2", "gemma3"} <= set(PRETRAINED_NAMES)
    assert ARCHITECTURE_NAMES == ("llama", "gpt2")
    with pytest.raises(ConfigError, match=r"^model.arch='mamba' is not one of llama, gpt2$"):
        architecture_config(ModelConfig(arch="mamba"), 32, {})
    with pytest.raises(ConfigError) as err:
        load_pretrained("smolm2", where="background.path")
    assert str(err.value) == ("background.path: 'smolm2' is neither a model folder nor a known model name "
                              "(smollm2, gemma3)")
