import re
from pathlib import Path

import pytest

from lightning_modules.pipeline.config import ConfigError, expert_spec, load_config, task_settings

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ROOT / "configs" / "default.yaml"
ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


def test_default_config_loads_with_two_experts():
    cfg = load_config(base=DEFAULT)
    assert [e.name for e in cfg.experts] == ["A_to_B", "C_to_D"]
    assert dict(cfg.experts[0].rules) == {"A": "B"}
    assert cfg.seed == 0 and cfg.expert.mode == "lora"
    # the letter settings live under `task:`, resolved against the task's own settings (defaults filled in)
    assert (cfg.task.name, cfg.task.alphabet, cfg.task.min_len, cfg.task.max_len) == ("letters", ALPHABET, 8, 16)
    assert (cfg.task.format, cfg.task.n_train, cfg.task.source_prob) == ("generative", 8000, 0.5)
    assert set(cfg.data) == {"batch_size", "num_workers"}
    settings = task_settings(cfg)
    assert type(settings).__name__ == "LettersConfig" and (settings.n_test, settings.alphabet) == (1000, ALPHABET)
    # the embedded schema alone is the letter task with its defaults
    assert load_config().task == cfg.task


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


def test_task_keys_merge_within_a_task_and_a_task_name_switch_replaces_the_node(tmp_path):
    fast = load_config([str(ROOT / "configs/debug/fast.yaml")], base=DEFAULT)  # no task.name: merges
    assert (fast.task.name, fast.task.n_train, fast.task.alphabet) == ("letters", 256, ALPHABET)
    same = load_config(overrides=["task.name=letters", "task.n_val=7"], base=DEFAULT)
    assert (same.task.n_val, same.task.alphabet, same.task.min_len) == (7, ALPHABET, 8)
    # another task: the letters settings (alphabet A-Z, format, ...) are dropped, the new task's defaults apply
    switched = load_config(overrides=["task.name=intervals", "task.max_len=20"], base=DEFAULT)
    assert switched.task.name == "intervals" and "format" not in switched.task
    assert (switched.task.alphabet, switched.task.max_len, switched.task.source_prob) == (
        "abcdefghijklmnopqrstuvwxyz", 20, 0.8)
    # ... the same from a later file, and back again: nothing of the intervals node survives
    f = tmp_path / "back.yaml"
    f.write_text("task: {name: letters, max_len: 12}\n")
    back = load_config([str(ROOT / "configs/experiment/intervals.yaml"), str(f)], base=DEFAULT)
    assert (back.task.name, back.task.alphabet, back.task.min_len, back.task.max_len) == ("letters", ALPHABET, 8, 12)
    assert "skills" not in back.task and "min_segments" not in back.task


def test_task_errors_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"^command line: unknown config key 'task.n_trian'; did you mean task.n_train"):
        load_config(overrides=["task.n_trian=5"], base=DEFAULT)
    # a task key from a file is named with that file, also when a later source kept the same task
    bad = tmp_path / "bad.yaml"
    bad.write_text("task: {name: intervals, bogus_key: 1}\n")
    for files in ([bad], [ROOT / "configs/experiment/intervals.yaml", bad], [bad, ROOT / "configs/experiment/intervals.yaml"]):
        with pytest.raises(ConfigError, match=rf"^{re.escape(str(bad))}: unknown config key 'task.bogus_key'"):
            load_config([str(f) for f in files], base=DEFAULT)
    with pytest.raises(ConfigError, match="unknown config key 'task.format'"):  # a letters key, not an intervals one
        load_config(overrides=["task.name=intervals", "task.format=aligned"], base=DEFAULT)
    with pytest.raises(ConfigError, match="bad value for 'task.n_train'"):
        load_config(overrides=["task.n_train=many"], base=DEFAULT)
    with pytest.raises(ConfigError, match="task.name='nope' is not one of letters, intervals, text"):
        load_config(overrides=["task.name=nope"], base=DEFAULT)
    with pytest.raises(ConfigError, match="task: need 1 <= min_len <= max_len"):
        load_config(overrides=["task.min_len=20"], base=DEFAULT)
    with pytest.raises(ConfigError, match="task: must be a mapping with a 'name'"):
        load_config(overrides=["task=3"], base=DEFAULT)
    # the letter settings left `data:`
    with pytest.raises(ConfigError, match="unknown config key 'data.alphabet'"):
        load_config(overrides=["data.alphabet=ABC"], base=DEFAULT)


def test_experts_carry_their_mask_spec():
    cfg = load_config(overrides=["experts=[{name: a, weight: 0.5, rules: {A: B}}, "
                                 "{name: up, interval: {start: '[', end: ']'}, data: [x.jsonl]}]"], base=DEFAULT)
    a, up = cfg.experts
    assert (a.weight, up.weight, list(up.data)) == (0.5, 1.0, ["x.jsonl"])
    assert expert_spec(a) == {"rules": {"A": "B"}}
    assert expert_spec(up) == {"interval": {"start": "[", "end": "]", "regex": False}}
    with pytest.raises(ConfigError, match=r"experts: duplicate expert name\(s\) a"):
        load_config(overrides=["experts=[{name: a, rules: {A: B}}, {name: a, rules: {C: D}}]"], base=DEFAULT)
    with pytest.raises(ConfigError, match=r"experts\[0\].name='a b'"):
        load_config(overrides=["experts=[{name: 'a b', rules: {A: B}}]"], base=DEFAULT)
    with pytest.raises(ConfigError, match=r"^experts\[1\].name='composed' is reserved"):
        load_config(overrides=["experts=[{name: a, rules: {A: B}}, {name: composed, rules: {C: D}}]"], base=DEFAULT)
