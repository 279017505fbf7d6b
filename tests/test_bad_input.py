"""Every bad input is one named error before anything is written (issue 12, "Every bad input a named error").

Each case of `CASES` is refused by `load_config` + `stages.plan_run` (what `train.py` runs before writing) with a
one-line `ConfigError` naming the key and what it allows, and leaves the folder it names and everything around
it untouched. A few go through `train.py` itself: exit code 2, one `error: ...` line on stderr, no traceback.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from lightning_modules.pipeline.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ROOT / "configs" / "default.yaml"
FAST = ROOT / "configs" / "debug" / "fast.yaml"
ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"

# (id, overrides, files written into tmp_path {name: text}, fragments the message must hold: the key, the allowed
# values). `{tmp}` in an override is tmp_path; `{export}` a fresh copy of a valid export (damaged by `damage`).
CASES: list[tuple[str, list[str], dict[str, str], list[str]]] = [
    # ranges
    ("batch_size=0", ["data.batch_size=0"], {}, ["data.batch_size=0", "an integer >= 1"]),
    ("num_workers<0", ["data.num_workers=-1"], {}, ["data.num_workers=-1", ">= 0"]),
    ("min_len>max_len", ["task.min_len=20"], {}, ["min_len", "1 <= min_len <= max_len"]),
    ("n_val=0", ["task.n_val=0"], {}, ["task.n_val=0", "[1, 1,000,000]"]),
    ("n_train=1e9", ["task.n_train=1e9"], {}, ["task.n_train", "Integer"]),
    ("n_train=10^9", ["task.n_train=1000000000"], {}, ["task.n_train=1000000000", "[1, 1,000,000]", "MAX_ROWS"]),
    ("rows too long", ["task.n_train=1000", "task.max_len=100000"], {}, ["task.n_train=1000", "MAX_SPLIT_TOKENS"]),
    ("seed<0", ["seed=-1"], {}, ["seed=-1", "[0, 4294967295]"]),
    ("expert max_steps<0", ["expert.max_steps=-5"], {}, ["expert.max_steps=-5", ">= 1"]),
    ("background max_steps=0", ["background.max_steps=0"], {}, ["background.max_steps=0", ">= 1", "background.path"]),
    ("lr<0", ["expert.optim.lr=-1"], {}, ["expert.optim.lr=-1.0", "> 0"]),
    ("lr=inf", ["background.optim.lr=.inf"], {}, ["background.optim.lr=inf", "finite number > 0"]),
    ("warmup>1", ["expert.optim.warmup_ratio=2"], {}, ["expert.optim.warmup_ratio=2.0", "[0, 1]"]),
    ("lora.r=0", ["expert.lora.r=0"], {}, ["expert.lora.r=0", ">= 1"]),
    ("lora.alpha=0", ["expert.lora.alpha=0"], {}, ["expert.lora.alpha=0", "> 0"]),
    ("temperature=0", ["expert.temperature=0"], {}, ["expert.temperature=0.0", "> 0"]),
    ("reg_weight=nan", ["expert.reg_weight=nan"], {}, ["expert.reg_weight=nan", "finite number >= 0"]),
    ("jsd_beta>1", ["expert.jsd_beta=2"], {}, ["expert.jsd_beta=2.0", "[0, 1]"]),
    ("corruption>1", ["expert.corruption_prob=1.5"], {}, ["expert.corruption_prob=1.5", "[0, 1]"]),
    ("corruption range reversed", ["expert.corruption_prob=[0.5,0.2]"], {},
     ["expert.corruption_prob=[0.5, 0.2]", "[low, high]"]),
    ("weight=nan", ["experts.0.weight=nan"], {}, ["experts[0].weight=nan", "finite number"]),
    ("val_check_interval=0", ["trainer.val_check_interval=0"], {}, ["trainer.val_check_interval=0", ">= 1"]),
    ("limit_val_batches>1", ["trainer.limit_val_batches=1.5"], {}, ["trainer.limit_val_batches=1.5", "[0.0, 1.0]"]),
    ("eval_batch_size=0", ["composition.eval_batch_size=0"], {}, ["composition.eval_batch_size=0", ">= 1"]),
    ("val_limit=0", ["composition.val_limit=0"], {}, ["composition.val_limit=0", "null (all) or an integer >= 1"]),
    ("ablation_ks=[0]", ["ablation_ks=[0]"], {}, ["ablation_ks=[0]", "integers >= 1"]),
    # choices and types
    ("devices=0", ["trainer.devices=0"], {}, ["trainer.devices=0", "-1 (all)", "'auto'"]),
    ("devices repeated", ["trainer.devices=[0,0]"], {}, ["trainer.devices=[0, 0]", "device indices"]),
    ("precision=bogus", ["trainer.precision=bogus"], {}, ["trainer.precision='bogus'", "32-true", "bf16-mixed"]),
    ("strategy=bogus", ["trainer.strategy=bogus"], {}, ["trainer.strategy='bogus'", "ddp", "fsdp"]),
    ("fsdp on cpu", ["trainer.strategy=fsdp"], {}, ["strategy=fsdp", "accelerator"]),
    ("divergence", ["expert.divergence=kl2"], {}, ["expert.divergence='kl2'", "forward_kl"]),
    ("baselines", ["baselines=[foo]"], {}, ["baselines", "foo", "task_arithmetic, ties, dare"]),
    ("seed type", ["seed=abc"], {}, ["'seed'", "Integer"]),
    ("section as list", ["trainer=[1]"], {}, ["'trainer'", "must be a mapping, got a list"]),
    ("task as list", ["task=[1,2]"], {}, ["task", "mapping with a 'name'"]),
    ("experts as mapping", [], {"experts.yaml": "experts: {a: 1}\n"}, ["experts.yaml", "'experts'", "must be a list"]),
    ("yaml list", [], {"list.yaml": "- seed: 1\n- data: {batch_size: 4}\n"},
     ["list.yaml", "must be a mapping of keys", "got a list"]),
    ("repeated letter", ["task.alphabet=ABCDAEFG"], {}, ["task.alphabet", "repeats the character 'A'"]),
    ("unicode name", ["experts.0.name=Ä_to_B"], {}, ["experts[0].name='Ä_to_B'", "[A-Za-z0-9][A-Za-z0-9_.-]*"]),
    ("name with slash", ["experts.0.name=a/b"], {}, ["experts[0].name='a/b'", "[A-Za-z0-9][A-Za-z0-9_.-]*"]),
    ("experiment escapes", ["experiment=../escape"], {}, ["experiment='../escape'", "[A-Za-z0-9][A-Za-z0-9_.-]*"]),
    ("no such expert", ["experts.5.weight=2"], {}, ["experts.5.weight", "indices 0 to 1"]),
    # files and folders
    ("output_dir is a file", ["output_dir={tmp}/file.txt"], {"file.txt": "precious"}, ["output_dir=", "is a file"]),
    ("output_dir under a file", ["output_dir={tmp}/file.txt/run"], {"file.txt": "precious"},
     ["output_dir=", "file.txt is a file"]),
    ("ckpt missing", ["ckpt_path={tmp}/nope.ckpt"], {}, ["ckpt_path", "nope.ckpt", "'last'"]),
    ("resume nothing", ["ckpt_path=last"], {}, ["ckpt_path=last", "does not exist"]),
    # keys that go together
    ("heads divide hidden", ["model.hidden_size=30", "model.num_heads=4"], {},
     ["model.hidden_size=30", "multiple of model.num_heads=4"]),
    ("rows longer than positions", ["task.max_len=40"], {}, ["model.max_position_embeddings=64", ">= 84", "task.max_len"]),
    ("head on tied gpt2", ["expert.mode=head", "model.arch=gpt2"], {}, ["expert.mode=head", "untied", "model.arch=gpt2"]),
    ("compose_with + ablations", ["composition.compose_with=[{export}]", "ablations=[plain]"], {},
     ["composition.compose_with", "ablations=[]"]),
    ("compose_with + full", ["composition.compose_with=[{export}]", "ablations=[]", "expert.mode=full"], {},
     ["composition.compose_with", "expert.mode=lora"]),
]
if not torch.cuda.is_available():
    CASES.append(("gpu without cuda", ["trainer.accelerator=gpu"], {},
                  ["trainer.accelerator=gpu", "no such device", "trainer.accelerator=cpu"]))

# (id, damage done to the export copy, fragments): every path that loads an export verifies it first.
EXPORT_CASES: list[tuple[str, str, list[str]]] = [
    ("flipped byte", "flip", ["composition.compose_with", "experts/A_to_B/adapter_model.safetensors", "sha256 mismatch"]),
    ("extra pickle", "pickle", ["composition.compose_with", "experts/A_to_B/adapter_model.bin", "pickle"]),
    ("missing file", "missing", ["composition.compose_with", "experts/A_to_B/adapter_config.json", "missing"]),
    ("unlisted weights", "unlisted", ["composition.compose_with", "experts/A_to_B/extra.safetensors", "not listed"]),
    ("path leaves folder", "escape", ["composition.compose_with", "experts[0].path", "must stay inside the export"]),
    ("background into export", "background", ["background.path", "background/model.safetensors", "sha256 mismatch"]),
]


def tree(root: Path) -> dict[str, str]:
    """Every file under `root` with its sha256, and every folder (what "nothing written" compares)."""
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> Path:
    """A valid export for configs/debug/fast.yaml: its background and LoRA experts A_to_B, C_to_D."""
    from peft import LoraConfig, get_peft_model

    from compose.export import export_composition
    from data.tokenizer import build_char_tokenizer
    from lightning_modules.pipeline.config import LLAMA_LORA_TARGETS, ModelConfig
    from lightning_modules.pipeline.models import build_causal_lm

    tok = build_char_tokenizer(ALPHABET)
    model = build_causal_lm(ModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64), tok)
    lora = LoraConfig(r=2, lora_alpha=4, target_modules=LLAMA_LORA_TARGETS, lora_dropout=0.0)
    peft_model = get_peft_model(model, lora, adapter_name="A_to_B")
    peft_model.add_adapter("C_to_D", lora)
    path = tmp_path_factory.mktemp("exports") / "export"
    export_composition(path, tokenizer=tok, peft_model=peft_model, adapter_names=["A_to_B", "C_to_D"],
                       specs={"A_to_B": {"rules": {"A": "B"}}, "C_to_D": {"rules": {"C": "D"}}})
    shutil.copytree(path / "background", path.parent / "background")  # the same background, outside the export
    return path


def damaged_copy(export: Path, dest: Path, damage: str | None) -> Path:
    import yaml

    shutil.copytree(export, dest)
    adapter = dest / "experts" / "A_to_B"
    if damage == "flip":
        data = bytearray((adapter / "adapter_model.safetensors").read_bytes())
        data[len(data) // 2] ^= 0xFF
        (adapter / "adapter_model.safetensors").write_bytes(bytes(data))
    elif damage == "pickle":
        torch.save({}, adapter / "adapter_model.bin")
    elif damage == "missing":
        (adapter / "adapter_config.json").unlink()
    elif damage == "unlisted":
        shutil.copy(adapter / "adapter_model.safetensors", adapter / "extra.safetensors")
    elif damage == "escape":
        manifest = yaml.safe_load((dest / "composition.yaml").read_text())
        manifest["experts"][0]["path"] = "../outside"
        (dest / "composition.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False))
    elif damage == "background":
        data = bytearray((dest / "background" / "model.safetensors").read_bytes())
        data[-8] ^= 0xFF
        (dest / "background" / "model.safetensors").write_bytes(bytes(data))
    return dest


def compose_with(export: Path, background: Path) -> list[str]:
    """A run that trains E_to_F on `background` (a copy of `export`'s), composed with its A_to_B and C_to_D."""
    return [f"composition.compose_with=[{export}]", f"background.path={background}", "ablations=[]",
            "experts=[{name: E_to_F, rules: {E: F}}]"]


def assert_refused(tmp_path: Path, overrides: list[str], files: list[str], fragments: list[str]) -> str:
    """`load_config` + `plan_run` raise one line holding every fragment; nothing under tmp_path changes."""
    from lightning_modules.pipeline.stages import plan_run

    out = tmp_path / "run"
    before = tree(tmp_path)
    with pytest.raises(ConfigError) as info:
        plan_run(load_config([str(FAST), *files], [f"output_dir={out}", *overrides], base=DEFAULT))
    message = str(info.value)
    assert "\n" not in message and message.strip() == message
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    assert not out.exists()
    assert tree(tmp_path) == before
    return message


@pytest.mark.parametrize("overrides,files,fragments", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_naming_the_key_and_nothing_is_written(tmp_path, export, overrides, files, fragments):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    copy = damaged_copy(export, tmp_path / "export", None) if any("{export}" in o for o in overrides) else None
    overrides = [o.replace("{tmp}", str(tmp_path)).replace("{export}", str(copy)) for o in overrides]
    yaml_files = [str(tmp_path / name) for name in files if name.endswith(".yaml")]
    assert_refused(tmp_path, overrides, yaml_files, fragments)


@pytest.mark.parametrize("damage,fragments", [c[1:] for c in EXPORT_CASES], ids=[c[0] for c in EXPORT_CASES])
def test_every_path_that_loads_an_export_verifies_it(tmp_path, export, damage, fragments):
    copy = damaged_copy(export, tmp_path / "export", damage)
    overrides = compose_with(copy, export.parent / "background")
    if damage == "background":  # the export's background alone, no compose_with
        overrides = [f"background.path={copy / 'background'}", "ablations=[]"]
    assert_refused(tmp_path, overrides, [], fragments)


def test_the_table_covers_the_issue(export):
    assert len(CASES) + len(EXPORT_CASES) >= 30
    from compose.export import EXPERT_NAME_RE as _NAME_RE
    from lightning_modules.pipeline.config import NAME_RE

    assert NAME_RE.pattern == _NAME_RE.pattern  # expert names: the export's own rule


def test_an_intact_export_plans_and_a_weight_override_works(tmp_path, export):
    from lightning_modules.pipeline.stages import plan_run

    copy = damaged_copy(export, tmp_path / "export", None)
    for background in (export.parent / "background", copy / "background"):  # a copy, or the export's own
        plan = plan_run(load_config([str(FAST)], [f"output_dir={tmp_path / 'run'}", *compose_with(copy, background),
                                                  "experts.0.weight=2.0"], base=DEFAULT))
    assert (plan.trained, plan.frozen) == (["E_to_F"], ["A_to_B", "C_to_D"])
    assert plan.weights == {"E_to_F": 2.0, "A_to_B": 1.0, "C_to_D": 1.0}
    assert not (tmp_path / "run").exists()


@contextmanager
def unprivileged():
    """Run the block as `nobody` when the suite runs as root (root may write into any folder)."""
    if os.geteuid() != 0:
        yield
        return
    os.seteuid(65534)
    try:
        yield
    finally:
        os.seteuid(0)


def test_an_output_dir_that_cannot_be_written_is_refused():
    base = Path(tempfile.mkdtemp(prefix="ce-readonly-"))
    try:
        base.chmod(0o755)
        locked = base / "locked"
        locked.mkdir(mode=0o555)
        locked.chmod(0o555)
        with unprivileged():
            with pytest.raises(PermissionError):  # the check says what the kernel would do
                (locked / "probe").mkdir()
            message = assert_refused_at(locked / "run", ["not writable", str(locked)])
        assert not any(locked.iterdir())
        assert "output_dir=" in message
    finally:
        (base / "locked").chmod(0o755)
        shutil.rmtree(base)


def assert_refused_at(out: Path, fragments: list[str]) -> str:
    from lightning_modules.pipeline.stages import plan_run

    cfg = load_config([str(FAST)], [f"output_dir={out}"], base=DEFAULT)
    with pytest.raises(ConfigError) as info:
        plan_run(cfg)
    message = str(info.value)
    assert "\n" not in message and all(f in message for f in fragments), message
    assert not out.exists()
    return message


# ------------------------------------------------------------------------------ through train.py itself


def train(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("case", ["batch_size", "flipped_byte"])  # ~15 s each: the table above runs in-process
def test_train_py_exits_2_with_one_error_line_and_no_traceback(tmp_path, export, case):
    out = tmp_path / "run"
    if case == "batch_size":
        args, fragments = ["data.batch_size=0"], ["data.batch_size=0", ">= 1"]
    else:
        args = compose_with(damaged_copy(export, tmp_path / "export", "flip"), export.parent / "background")
        fragments = ["composition.compose_with", "adapter_model.safetensors", "sha256 mismatch"]
    before = tree(tmp_path)
    proc = train(str(FAST), f"output_dir={out}", *args)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert all(f in lines[0] for f in fragments), lines[0]
    assert "Traceback" not in proc.stderr + proc.stdout and proc.stdout == ""
    assert not out.exists() and tree(tmp_path) == before
