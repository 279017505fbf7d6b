"""`expert.lora.layers`: adapters on some decoder layers only (peft's `layers_to_transform`), refused where the
model lacks the layers or the targets adapt the output head; their export composes on the shared trunk."""

import re
from pathlib import Path

import pytest
from safetensors import safe_open
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_modules.expert import ExpertLM, ExpertSettings, SettingsError
from lightning_modules.pipeline.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ROOT / "configs" / "default.yaml"
FAST = ROOT / "configs" / "debug" / "fast.yaml"


def _llama(layers: int = 4) -> LlamaForCausalLM:
    return LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


def _adapted_layers(module: ExpertLM, name: str) -> set[int]:
    return {int(re.search(r"layers\.(\d+)\.", k).group(1)) for k in module.peft_model.state_dict()
            if f".{name}." in k and "lora_" in k}


@pytest.mark.parametrize(("layers", "expected"), [("top_2", {2, 3}), ((0, 3), {0, 3}), ("top_4", {0, 1, 2, 3})])
@pytest.mark.parametrize("targets", ["all-linear", ("q_proj", "v_proj")])
def test_adapters_sit_on_the_chosen_layers_only(layers, expected, targets):
    module = ExpertLM(_llama(), ["a", "b"], ExpertSettings(lora_layers=layers, target_modules=targets))
    for name in ("a", "b"):
        assert _adapted_layers(module, name) == expected
    kinds = {k.split(".lora_")[0].rsplit(".", 1)[-1] for k in module.peft_model.state_dict() if "lora_A" in k}
    assert kinds == ({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
                     if targets == "all-linear" else set(targets))


@pytest.mark.parametrize(("layers", "message"), [
    ("top_0", "give top_L"), ("bottom_2", "give top_L"), ([], "non-empty list"), ([1, 1], "distinct"),
    ([-1], "layer indices >= 0"), ([True], "layer indices >= 0")])
def test_bad_layer_choices_are_named(layers, message):
    with pytest.raises(SettingsError, match=message) as info:
        ExpertSettings(lora_layers=layers)
    assert str(info.value).startswith("lora_layers=")


def test_layers_do_not_go_with_the_output_head_or_a_pattern():
    with pytest.raises(SettingsError, match="adapts the output head"):
        ExpertSettings(lora_layers="top_2", target_modules=("q_proj", "lm_head"))
    with pytest.raises(SettingsError, match="as a list of module names or all-linear"):
        ExpertSettings(lora_layers="top_2", target_modules=".*proj")


def test_layers_the_model_lacks():
    with pytest.raises(SettingsError, match="only 4 decoder layers"):
        ExpertLM(_llama(), ["a"], ExpertSettings(lora_layers="top_5"))
    with pytest.raises(SettingsError, match="layers 0 to 3 only .no layer 7."):
        ExpertLM(_llama(), ["a"], ExpertSettings(lora_layers=(1, 7)))


def _config_error(*overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config([str(FAST)], ["ablations=[]", *overrides], base=DEFAULT)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_config_errors_name_the_key_before_anything_runs():
    msg = _config_error("model.num_layers=2", "expert.lora.layers=top_3")
    assert msg.startswith("expert.lora.layers=top_3: the model has only 2 decoder layers") and "model.num_layers" in msg
    msg = _config_error("model.num_layers=2", "expert.lora.layers=[0,2]")
    assert msg.startswith("expert.lora.layers=[0, 2]")
    msg = _config_error("expert.lora.layers=top_1", "expert.lora.target_modules=[q_proj,lm_head]")
    assert "expert.lora.target_modules=['q_proj', 'lm_head'] adapts the output head" in msg
    assert "expert.lora.layers=null" in msg
    assert _config_error("expert.lora.layers=3").startswith("expert.lora.layers=3: give top_L")


def test_an_export_of_top_layer_experts_composes_on_the_shared_trunk(tmp_path):
    from compose import ComposedLM
    from lightning_modules.pipeline.stages import run

    out = tmp_path / "run"
    cfg = load_config([str(FAST)], [f"output_dir={out}", "ablations=[]", "baselines=[]", "model.num_layers=3",
                                    "expert.lora.layers=top_1"], base=DEFAULT)
    assert cfg.expert.lora.layers == "top_1"
    run(cfg)
    for name in ("A_to_B", "C_to_D"):
        with safe_open(out / "export" / "experts" / name / "adapter_model.safetensors", framework="pt") as f:
            assert {int(re.search(r"layers\.(\d+)\.", k).group(1)) for k in f.keys()} == {2}
    composed = ComposedLM.from_manifest(out / "export")
    assert composed.paths.trunk_start == 2 and composed.paths.num_layers == 3
    assert "shared trunk: layers 0-1 of 3" in composed.describe()
