"""`expert.init_from`: experts started from an exported adapter or model folder, trained further with the
regularizer; and every folder that does not fit the background refused in one line before anything is trained."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lightning_modules.pipeline.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ROOT / "configs" / "default.yaml"
FAST = ROOT / "configs" / "debug" / "fast.yaml"
# A background that copies well and experts that learn their rule, each stage in seconds.
COMMON = ["ablations=[]", "baselines=[]", "expert.max_steps=40", "trainer.val_check_interval=40"]


def _config(out: Path, *overrides: str):
    return load_config([str(FAST)], [f"output_dir={out}", *COMMON, *overrides], base=DEFAULT)


def _run(out: Path, *overrides: str) -> dict:
    from lightning_modules.pipeline.stages import run

    return run(_config(out, *overrides))


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """Experts trained with λ = 0 (off-the-shelf fine-tuning), exported."""
    out = tmp_path_factory.mktemp("plain") / "run"
    return out, _run(out, "background.max_steps=150", "expert.reg_weight=0")


@pytest.fixture(scope="module")
def plain_full(plain, tmp_path_factory):
    """Full fine-tuned experts (expert.mode=full, λ = 0) on the same background, exported as model folders."""
    out = tmp_path_factory.mktemp("plain_full") / "run"
    return out, _run(out, f"background.path={plain[0] / 'background'}", "expert.reg_weight=0", "expert.mode=full",
                     "expert.max_steps=20", "expert.optim.lr=1e-3")


def _init_from(export: Path) -> str:
    return f"expert.init_from={{A_to_B: {export / 'experts/A_to_B'}, C_to_D: {export / 'experts/C_to_D'}}}"


def test_an_unregularized_adapter_trained_further_with_the_regularizer_keeps_its_skill(plain, tmp_path, capsys):
    out, before = plain
    after = _run(tmp_path / "repaired", f"background.path={out / 'background'}", _init_from(out / "export"),
                 "expert.reg_weight=3")
    assert f"[experts] A_to_B starts from {out / 'export/experts/A_to_B'}" in capsys.readouterr().out
    for name in ("A_to_B", "C_to_D"):
        b, a = before["experts"][name], after["experts"][name]
        assert b["exact_match"] >= 0.9  # the skill is there to keep
        assert a["exact_match"] >= 0.95 * b["exact_match"]
        assert a["off_mask_kl"] < 0.5 * b["off_mask_kl"]


def test_the_expert_starts_from_the_adapters_weights(plain, tmp_path):
    from lightning_modules.pipeline.build import build_expert, build_task, expert_background

    out, _ = plain
    cfg = _config(tmp_path / "r", f"background.path={out / 'background'}", _init_from(out / "export"))
    task = build_task(cfg)
    module = build_expert(cfg, task, expert_background(cfg, out / "background", task.tokenizer))
    for name in ("A_to_B", "C_to_D"):
        saved = load_file(out / "export" / "experts" / name / "adapter_model.safetensors")
        ours = {k: v for k, v in module.peft_model.state_dict().items() if f".{name}." in k and "lora_" in k}
        assert len(ours) == len(saved) > 0
        for key, value in saved.items():
            assert torch.equal(ours[key.replace(".weight", f".{name}.weight")], value)
        assert all(p.requires_grad for k, p in module.peft_model.named_parameters() if f".{name}." in k)


def test_one_folder_starts_the_one_expert_of_a_run(plain, tmp_path):
    out, _ = plain
    cfg = _config(tmp_path / "r", f"background.path={out / 'background'}", "experts=[{name: A_to_B, rules: {A: B}}]",
                  f"expert.init_from={out / 'export/experts/A_to_B'}")
    from lightning_modules.pipeline.init_from import init_from_folders

    assert init_from_folders(cfg) == {"A_to_B": out / "export/experts/A_to_B"}


def test_a_full_model_starts_a_full_expert(plain, plain_full, tmp_path):
    from lightning_modules.pipeline.build import build_expert, build_task, expert_background

    background, full = plain[0] / "background", plain_full[0] / "export"
    cfg = _config(tmp_path / "r", f"background.path={background}", "expert.mode=full", _init_from(full))
    task = build_task(cfg)
    module = build_expert(cfg, task, expert_background(cfg, background, task.tokenizer))
    saved = load_file(full / "experts" / "A_to_B" / "model.safetensors")
    state = module.experts["A_to_B"].state_dict()
    assert all(torch.equal(state[k], v) for k, v in saved.items())
    assert not torch.equal(state["lm_head.weight"], module.background.state_dict()["lm_head.weight"])
    summary = _run(tmp_path / "repaired", f"background.path={background}", "expert.mode=full", _init_from(full),
                   "expert.reg_weight=3", "expert.max_steps=30", "expert.optim.lr=1e-4")
    for name in ("A_to_B", "C_to_D"):
        before, after = plain_full[1]["experts"][name], summary["experts"][name]
        assert after["off_mask_kl"] < before["off_mask_kl"]
        assert after["exact_match"] >= 0.95 * before["exact_match"]


def test_an_adapter_merged_into_a_full_expert(plain, tmp_path):
    from lightning_modules.pipeline.build import build_expert, build_task, expert_background

    out, _ = plain
    cfg = _config(tmp_path / "r", f"background.path={out / 'background'}", "expert.mode=full",
                  _init_from(out / "export"))
    task = build_task(cfg)
    module = build_expert(cfg, task, expert_background(cfg, out / "background", task.tokenizer))
    ids = torch.tensor([task.tokenizer.convert_tokens_to_ids(list("ABCABC"))])
    with torch.no_grad():
        expert = module.experts["A_to_B"](input_ids=ids).logits
        background = module.background(input_ids=ids).logits
    assert not torch.allclose(expert, background, atol=1e-4)  # the adapter's difference is in the copy


# ---------------------------------------------------------------------- bad input


def _error(tmp_path, *overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        _config(tmp_path / "never", *overrides)
    message = str(info.value)
    assert "\n" not in message and "expert.init_from" in message
    assert not (tmp_path / "never").exists()
    return message


def _save_variant(plain_out: Path, dest: Path, change) -> Path:
    from lightning_modules.pipeline.models import load_pretrained

    model = change(load_pretrained(plain_out / "background"))
    model.save_pretrained(dest)
    return dest


def test_a_folder_that_is_neither_adapter_nor_model(plain, tmp_path):
    (tmp_path / "empty").mkdir()
    msg = _error(tmp_path, f"background.path={plain[0] / 'background'}",
                 f"expert.init_from={{A_to_B: {tmp_path / 'empty'}}}")
    assert "neither a PEFT adapter folder" in msg and "expert.init_from.A_to_B" in msg


def test_an_adapter_of_another_background_by_its_recorded_checksums(plain, tmp_path):
    out, _ = plain

    def shifted(model):
        with torch.no_grad():
            next(model.parameters()).add_(1.0)
        return model

    other = _save_variant(out, tmp_path / "other", shifted)
    msg = _error(tmp_path, f"background.path={other}", _init_from(out / "export"))
    assert "trained on another background" in msg and "composition.yaml" in msg
    # outside its export, the adapter's base_model_name_or_path records its background
    loose = shutil.copytree(out / "export/experts/A_to_B", tmp_path / "loose")
    msg = _error(tmp_path, f"background.path={other}", f"expert.init_from={{A_to_B: {loose}}}")
    assert "trained on another background (base_model_name_or_path=" in msg


def test_an_adapter_whose_shapes_do_not_fit(plain, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    out, _ = plain
    loose = shutil.copytree(out / "export/experts/A_to_B", tmp_path / "loose")
    config = json.loads((loose / "adapter_config.json").read_text())
    (loose / "adapter_config.json").write_text(json.dumps(config | {"base_model_name_or_path": "somewhere/else"}))
    theirs = json.loads((out / "background/config.json").read_text())
    wider = LlamaForCausalLM(LlamaConfig(**{**theirs, "hidden_size": 48, "head_dim": 24}))
    wider.save_pretrained(tmp_path / "wider")
    msg = _error(tmp_path, f"background.path={tmp_path / 'wider'}", f"expert.init_from={{A_to_B: {loose}}}")
    assert "does not fit" in msg and "trained on another model" in msg


def test_a_full_model_of_another_architecture_or_vocabulary(plain, tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    out, _ = plain
    theirs = json.loads((out / "background/config.json").read_text())
    GPT2LMHeadModel(GPT2Config(vocab_size=theirs["vocab_size"], n_embd=32, n_layer=1, n_head=2)).save_pretrained(
        tmp_path / "gpt2")
    msg = _error(tmp_path, f"background.path={out / 'background'}", "expert.mode=full",
                 f"expert.init_from={{A_to_B: {tmp_path / 'gpt2'}}}")
    assert "another architecture" in msg and "'gpt2'" in msg

    def grown(model):
        model.resize_token_embeddings(theirs["vocab_size"] + 8)
        return model

    bigger = _save_variant(out, tmp_path / "bigger", grown)
    msg = _error(tmp_path, f"background.path={out / 'background'}", "expert.mode=full",
                 f"expert.init_from={{A_to_B: {bigger}}}")
    assert "another vocabulary" in msg


def test_folder_kind_and_mode_go_together(plain, tmp_path):
    msg = _error(tmp_path, f"background.path={plain[0] / 'background'}", "expert.mode=lora",
                 f"expert.init_from={{A_to_B: {plain[0] / 'background'}}}")
    assert "is a full model" in msg and "expert.mode=full" in msg
    msg = _error(tmp_path, f"background.path={plain[0] / 'background'}", "expert.mode=head",
                 _init_from(plain[0] / "export"))
    assert "PEFT adapter" in msg and "expert.mode=lora or full" in msg


def test_the_form_of_init_from(plain, tmp_path):
    background, adapter = plain[0] / "background", plain[0] / "export/experts/A_to_B"
    assert "trains 2 (A_to_B, C_to_D)" in _error(tmp_path, f"background.path={background}",
                                                   f"expert.init_from={adapter}")
    assert "'nobody' is not an expert" in _error(tmp_path, f"background.path={background}",
                                                  f"expert.init_from={{nobody: {adapter}}}")
    assert "needs background.path" in _error(tmp_path, f"expert.init_from={{A_to_B: {adapter}}}")
    # init_base lets a run tune its background, but only from model.pretrained_path: one trained from scratch (as
    # here) fits no existing expert
    assert "needs background.path" in _error(tmp_path, f"expert.init_from={{A_to_B: {adapter}}}",
                                             f"expert.init_base={background}")


# ---------------------------------------------------------------------- moved onto another background


def _nudged(seed: int):
    """A change of every weight, as tuning the background on a format would make."""
    def change(model):
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * torch.randn(p.shape, generator=generator))
        return model
    return change


def test_an_adapter_moves_onto_a_background_tuned_from_its_own(plain, tmp_path):
    from lightning_modules.pipeline.build import build_expert, build_task, expert_background
    from lightning_modules.pipeline.models import load_pretrained

    out, _ = plain
    tuned = _save_variant(out, tmp_path / "tuned", _nudged(0))
    assert "trained on another background" in _error(tmp_path, f"background.path={tuned}", _init_from(out / "export"))
    cfg = _config(tmp_path / "r", f"background.path={tuned}", _init_from(out / "export"),
                  f"expert.init_base={out / 'background'}")
    task = build_task(cfg)
    module = build_expert(cfg, task, expert_background(cfg, tuned, task.tokenizer))
    saved = load_file(out / "export" / "experts" / "A_to_B" / "adapter_model.safetensors")
    ours = module.peft_model.state_dict()
    assert all(torch.equal(ours[k.replace(".weight", ".A_to_B.weight")], v) for k, v in saved.items())
    base = {k.removeprefix("base_model.model.").replace(".base_layer", ""): v for k, v in ours.items()
            if "lora_" not in k}
    want = load_pretrained(tuned).state_dict()
    assert all(torch.equal(base[k], want[k]) for k in want if k in base) and len(set(base) & set(want)) > 10


def test_a_full_model_moves_onto_a_background_tuned_from_its_own(plain, plain_full, tmp_path):
    from lightning_modules.pipeline.build import build_expert, build_task, expert_background
    from lightning_modules.pipeline.models import load_pretrained

    background, full = plain[0] / "background", plain_full[0] / "export"
    tuned = _save_variant(plain[0], tmp_path / "tuned", _nudged(0))
    cfg = _config(tmp_path / "r", f"background.path={tuned}", "expert.mode=full", _init_from(full),
                  f"expert.init_base={background}")
    task = build_task(cfg)
    module = build_expert(cfg, task, expert_background(cfg, tuned, task.tokenizer))
    start, trained, moved = (dict(m.named_parameters()) for m in (
        load_pretrained(background), load_pretrained(full / "experts" / "A_to_B"), load_pretrained(tuned)))
    ours = dict(module.experts["A_to_B"].named_parameters())
    assert set(ours) == set(moved)
    for name, p in ours.items():
        torch.testing.assert_close(p, moved[name] + (trained[name] - start[name]), rtol=0, atol=1e-6)
    assert any(not torch.equal(trained[n], start[n]) for n in ours)  # the fine-tune changed something to move


def test_init_base_that_does_not_fit(plain, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    out, _ = plain
    background = out / "background"

    def error(*overrides: str) -> str:
        with pytest.raises(ConfigError) as info:
            _config(tmp_path / "never", *overrides)
        assert "\n" not in str(info.value) and not (tmp_path / "never").exists()
        return str(info.value)

    assert "set without expert.init_from" in error(f"background.path={background}", f"expert.init_base={background}")
    (tmp_path / "empty").mkdir()
    msg = error(f"background.path={background}", _init_from(out / "export"), f"expert.init_base={tmp_path / 'empty'}")
    assert msg.startswith("expert.init_base=") and "not an HF model folder" in msg
    theirs = json.loads((background / "config.json").read_text())
    LlamaForCausalLM(LlamaConfig(**{**theirs, "hidden_size": 48, "head_dim": 24})).save_pretrained(tmp_path / "wider")
    msg = error(f"background.path={background}", _init_from(out / "export"), f"expert.init_base={tmp_path / 'wider'}")
    assert msg.startswith("expert.init_base=") and "another size of model" in msg
    # a background tuned in this run from model.pretrained_path: the folders and the base must fit that model
    cfg = _config(tmp_path / "r", f"model.pretrained_path={background}", _init_from(out / "export"),
                  f"expert.init_base={background}")
    assert cfg.background.path is None and cfg.expert.init_base == str(background)
    msg = error(f"model.pretrained_path={tmp_path / 'wider'}", _init_from(out / "export"),
                f"expert.init_base={background}")
    assert msg.startswith("expert.init_base=") and "another size of model" in msg
    # an adapter whose recorded background is not the base named
    other = _save_variant(out, tmp_path / "other", _nudged(1))
    tuned = _save_variant(out, tmp_path / "tuned", _nudged(0))
    msg = _error(tmp_path, f"background.path={tuned}", _init_from(out / "export"), f"expert.init_base={other}")
    assert "trained on another background" in msg and f"than expert.init_base={other}" in msg
