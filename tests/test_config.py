from pathlib import Path

import pytest

from lightning_modules.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ROOT / "configs" / "default.yaml"


def test_default_config_loads_with_two_experts():
    cfg = load_config(base=DEFAULT)
    assert [e.name for e in cfg.experts] == ["A_to_B", "C_to_D"]
    assert dict(cfg.experts[0].rules) == {"A": "B"}
    assert cfg.seed == 0 and cfg.expert.mode == "lora"


def test_files_merge_in_order_then_overrides(tmp_path):
    f1 = tmp_path / "a.yaml"
    f1.write_text("seed: 3\nexpert: {reg_weight: 0.5}\n")
    f2 = tmp_path / "b.yaml"
    f2.write_text("seed: 4\n")
    cfg = load_config([str(f1), str(f2)], ["expert.divergence=log_ratio"], base=DEFAULT)
    assert cfg.seed == 4 and cfg.expert.reg_weight == 0.5 and cfg.expert.divergence == "log_ratio"
    k8 = load_config([str(ROOT / "configs/experiment/letters_k8.yaml")], base=DEFAULT)
    assert len(k8.experts) == 8


def test_unknown_key_names_it_and_suggests():
    with pytest.raises(ConfigError, match=r"unknown config key 'expert.reg_wieght'.*expert.reg_weight"):
        load_config(overrides=["expert.reg_wieght=1"], base=DEFAULT)


def test_unknown_key_in_file_names_file(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("trainer: {max_stepz: 3}\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: unknown config key 'trainer.max_stepz'"):
        load_config([str(f)], base=DEFAULT)


def test_wrong_type_names_key():
    with pytest.raises(ConfigError, match="expert.max_steps"):
        load_config(overrides=["expert.max_steps=many"], base=DEFAULT)


def test_bad_choice_and_missing_file():
    with pytest.raises(ConfigError, match="expert.divergence='kl2' is not one of"):
        load_config(overrides=["expert.divergence=kl2"], base=DEFAULT)
    with pytest.raises(ConfigError, match="config file not found: nope.yaml"):
        load_config(["nope.yaml"], base=DEFAULT)
    with pytest.raises(ConfigError, match="not of the form"):
        load_config(overrides=["seed"], base=DEFAULT)
