"""Every bad input is one named error before anything is written.

Each case of `CASES` is refused by `load_config` + `stages.plan_run` (what `train.py` runs before writing) with a
one-line `ConfigError` naming the key and what it allows, and leaves the folder it names and everything around
it untouched. `TEXT_CASES` do the same for the text task's data files and tokenizer folders (the file and its
1-based line or row, and nothing else printed). A few go through `train.py` itself: exit code 2, one
`error: ...` line on stderr, no traceback.
"""

from __future__ import annotations

import codecs
import csv
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
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
    ("threads=0", ["trainer.threads=0"], {}, ["trainer.threads=0", "an integer >= 1"]),
    ("threads=1.5", ["trainer.threads=1.5"], {}, ["trainer.threads", "Integer"]),
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


def assert_refused(tmp_path: Path, overrides: list[str], files: list[str], fragments: list[str],
                   config: Path = FAST) -> str:
    """`load_config` + `plan_run` raise one line holding every fragment; nothing under tmp_path changes."""
    from lightning_modules.pipeline.stages import plan_run

    out = tmp_path / "run"
    before = tree(tmp_path)
    with pytest.raises(ConfigError) as info:
        plan_run(load_config([str(config), *files], [f"output_dir={out}", *overrides], base=DEFAULT))
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


# ------------------------------------------------------------------------------ the text task's files and tokenizer
TEXT = ROOT / "configs" / "experiment" / "text_fast.yaml"
TEXT_FIXTURE = ROOT / "tests" / "fixtures" / "text"
CALC_LINES = (TEXT_FIXTURE / "calc.jsonl").read_text().splitlines(keepends=True)
TWO_ROWS = "".join(CALC_LINES[:2])  # the bad line below is line 3
# Where a path goes in the text config (`configs/experiment/text_fast.yaml`).
TEXT_KEYS = {"data": "experts.0.data=[{}]", "general": "task.general=[{}]",
             "compositional": "task.compositional=[{}]", "tokenizer": "task.tokenizer={}"}


def file_of(content: str | bytes) -> Callable[[Path], None]:
    data = content.encode() if isinstance(content, str) else content
    return lambda path: path.write_bytes(data)


def folder_of(**files: str) -> Callable[[Path], None]:
    def make(path: Path) -> None:
        path.mkdir()
        for name, text in files.items():
            (path / name).write_text(text)
    return make


def parquet_of(**columns: list) -> Callable[[Path], None]:
    def make(path: Path) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table(columns), path)
    return make


def link_to(target: str) -> Callable[[Path], None]:
    return lambda path: path.symlink_to(target)


TOKENIZER_CONFIG = (TEXT_FIXTURE / "tokenizer" / "tokenizer_config.json").read_text()
# (id, key, file name under tmp_path, how it is made (None: not at all), fragments of the message)
TEXT_CASES: list[tuple[str, str, str, Callable[[Path], None] | None, list[str]]] = [
    # encodings
    ("latin-1 line", "data", "calc.jsonl",
     file_of(TWO_ROWS.encode() + '{"prompt": "Qué?\\n", "response": "<<1+1=2>>2"}\n'.encode("latin-1")),
     ["calc.jsonl line 3: not UTF-8 text (byte 0xe9 at byte 15 of the line)", "save the file as UTF-8"]),
    ("utf-16", "general", "general.jsonl", file_of(TWO_ROWS.encode("utf-16")),
     ["general.jsonl: not UTF-8 text", "UTF-16 byte-order mark"]),
    ("latin-1 csv", "compositional", "comp.csv", file_of(b"prompt,response\r\nQ,A\r\nQ\xe9,A\r\n"),
     ["comp.csv line 3: not UTF-8 text (byte 0xe9 at byte 2 of the line)"]),
    # malformed JSON Lines / JSON / CSV / Parquet
    ("jsonl line malformed", "data", "calc.jsonl", file_of(TWO_ROWS + '{"prompt": "Q\\n", "response": }\n'),
     ["calc.jsonl line 3: not valid JSON: Expecting value (column 31)"]),
    ("jsonl line after crlf", "data", "calc.jsonl", file_of(TWO_ROWS.replace("\n", "\r\n") + "{oops\r\n"),
     ["calc.jsonl line 3: not valid JSON: Expecting property name"]),
    ("jsonl line not an object", "data", "calc.jsonl", file_of(TWO_ROWS + '["Q", "A"]\n'),
     ["calc.jsonl line 3: a row must be a JSON object", "got a list"]),
    ("json array malformed", "general", "general.json",
     file_of('[\n {"prompt": "Q", "response": "A"},\n {"prompt": "Q" "response": "A"}\n]\n'),
     ["general.json line 3: not valid JSON: Expecting ',' delimiter"]),
    ("json not rows", "general", "general.json", file_of('"just a string"'),
     ["general.json: a JSON data file holds a list of row objects", "got a string"]),
    ("json array item", "general", "general.json", file_of('[{"prompt": "Q", "response": "A"}, 7]'),
     ["general.json row 2: a row must be a JSON object", "got a number"]),
    ("csv too many fields", "data", "calc.csv", file_of("prompt,response\nQ,A\nQ,A,B\n"),
     ["calc.csv line 3: 3 field(s), the header has 2"]),
    ("csv bad quote", "data", "calc.csv", file_of('prompt,response\nQ,A\n"Q"x,A\n'),
     ["calc.csv line 3: not valid CSV"]),
    ("not parquet", "compositional", "comp.parquet", file_of(b"PAR1 this is no parquet file"),
     ["comp.parquet: not a readable Parquet file", "magic bytes"]),
    # missing or non-text fields
    ("row lacks response", "data", "calc.jsonl", file_of(TWO_ROWS + '{"prompt": "Q\\n"}\n'),
     ["calc.jsonl line 3: the row lacks the field(s) ['response']"]),
    ("field is a number", "data", "calc.jsonl", file_of(TWO_ROWS + '{"prompt": 7, "response": "A"}\n'),
     ["calc.jsonl line 3: field 'prompt' is not text: 7"]),
    ("field is null", "general", "general.jsonl", file_of(TWO_ROWS + '{"prompt": "Q", "response": null}\n'),
     ["general.jsonl line 3: field 'response' is not text: None"]),
    ("parquet field not text", "data", "calc.parquet", parquet_of(prompt=["Q", "Q"], response=["A", None]),
     ["calc.parquet row 2: field 'response' is not text: None"]),
    ("csv lacks the fields", "data", "calc.csv", file_of("question,answer\nQ,A\n"),
     ["calc.csv: rows lack the field(s) ['prompt', 'response']", "['question', 'answer']"]),
    ("only blank lines", "data", "calc.jsonl", file_of("\n\r\n   \n"), ["calc.jsonl: data file is empty (no rows)"]),
    # not a readable file
    ("data file is a folder", "data", "calc.jsonl", folder_of(), ["calc.jsonl: is a folder, not a data file"]),
    ("folder of data files", "general", "rows", folder_of(**{"a.jsonl": TWO_ROWS}), ["rows: is a folder, not a data file"]),
    ("symlink loop", "data", "calc.jsonl", link_to("calc.jsonl"), ["calc.jsonl: symbolic link loop"]),
    ("dangling symlink", "data", "calc.jsonl", link_to("gone.jsonl"),
     ["calc.jsonl: data file not found (a symbolic link to gone.jsonl"]),
    # tokenizer folders
    ("tokenizer folder missing", "tokenizer", "tok", None, ["task.tokenizer: tokenizer folder not found: ", "/tok"]),
    ("tokenizer folder empty", "tokenizer", "tok", folder_of(), ["task.tokenizer: tokenizer folder ", "/tok is empty"]),
    ("not a tokenizer folder", "tokenizer", "tok", folder_of(**{"calc.jsonl": TWO_ROWS}),
     ["/tok is not a tokenizer folder (no tokenizer.json / tokenizer_config.json", "it holds calc.jsonl"]),
    ("tokenizer is a file", "tokenizer", "tok", file_of("{}"), ["/tok is a file, not a tokenizer folder"]),
    ("tokenizer config only", "tokenizer", "tok", folder_of(**{"tokenizer_config.json": TOKENIZER_CONFIG}),
     ["/tok has a tokenizer_config.json but no vocabulary the tokenizer can load (tokenizer.json"]),
    ("tokenizer.json broken", "tokenizer", "tok",
     folder_of(**{"tokenizer.json": "{", "tokenizer_config.json": TOKENIZER_CONFIG}),
     ["task.tokenizer: tokenizer folder ", "/tok: cannot load the tokenizer in it: "]),
]


def assert_text_refused(tmp_path: Path, capfd, key: str, path: Path, fragments: list[str]) -> str:
    """The text config with `path` at `key` is refused in one line naming `path`, nothing is written, and
    nothing else is printed (no library's own log line)."""
    capfd.readouterr()
    message = assert_refused(tmp_path, [TEXT_KEYS[key].format(path)], [], fragments, config=TEXT)
    assert message.startswith("task.tokenizer: " if key == "tokenizer" else str(path)) and str(path) in message
    assert capfd.readouterr() == ("", "")
    return message


@pytest.mark.parametrize("key,name,make,fragments", [c[1:] for c in TEXT_CASES], ids=[c[0] for c in TEXT_CASES])
def test_a_bad_text_file_or_tokenizer_folder_is_one_line_naming_it(tmp_path, capfd, key, name, make, fragments):
    path = tmp_path / name
    if make is not None:
        make(path)
    assert_text_refused(tmp_path, capfd, key, path, fragments)


def test_a_data_file_this_user_cannot_read_is_refused(capfd):
    base = Path(tempfile.mkdtemp(prefix="ce-unreadable-"))
    try:
        base.chmod(0o777)  # `nobody` could create the run folder here (it must not)
        path = base / "calc.jsonl"
        path.write_text(TWO_ROWS)
        path.chmod(0o000)
        plan_text_run(base / "run")  # every module the check imports, imported while the interpreter's files are readable
        capfd.readouterr()
        with unprivileged():
            with pytest.raises(PermissionError):  # the check says what the kernel would do
                path.read_bytes()
            with pytest.raises(ConfigError) as info:
                plan_text_run(base / "run", f"experts.0.data=[{path}]")
        assert str(info.value) == f"{path}: cannot be read by this user (permission denied)"
        assert capfd.readouterr() == ("", "")
        assert [p.name for p in base.iterdir()] == ["calc.jsonl"]
    finally:
        shutil.rmtree(base)


def plan_text_run(out: Path, *overrides: str):
    from lightning_modules.pipeline.stages import plan_run

    return plan_run(load_config([str(TEXT)], [f"output_dir={out}", *overrides], base=DEFAULT))


def test_a_utf8_bom_and_mixed_line_ends_load_as_the_plain_files_do(tmp_path):
    """The fixture's rows with a byte-order mark and `\\r\\n`/`\\n`/`\\r` line ends (JSON Lines, and the general rows
    as CSV) give the same task rows as the fixture itself."""
    ends = ["\r\n", "\n", "\r"]
    calc = (TEXT_FIXTURE / "calc.jsonl").read_text().splitlines()
    (tmp_path / "calc.jsonl").write_bytes(codecs.BOM_UTF8 + "".join(
        line + ends[i % 3] for i, line in enumerate(calc)).encode())
    table = io.StringIO()
    writer = csv.writer(table, lineterminator="\r\n")
    writer.writerow(["prompt", "response"])
    general = [json.loads(line) for line in (TEXT_FIXTURE / "general.jsonl").read_text().splitlines()]
    writer.writerows((row["prompt"], row["response"]) for row in general)
    (tmp_path / "general.csv").write_bytes(codecs.BOM_UTF8 + table.getvalue().encode())

    ours = plan_text_run(tmp_path / "run", f"experts.0.data=[{tmp_path / 'calc.jsonl'}]",
                         f"task.general=[{tmp_path / 'general.csv'}]").task
    reference = plan_text_run(tmp_path / "run").task
    for split in ("train", "val", "test"):
        assert ours.expert_dataset(split).to_list() == reference.expert_dataset(split).to_list(), split
        assert ours.background_dataset(split).to_list() == reference.background_dataset(split).to_list(), split
    assert len(ours.expert_dataset("train")) > 0 and not (tmp_path / "run").exists()


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


@pytest.mark.parametrize("case", ["batch_size", "flipped_byte", "latin-1 data file"])  # ~15 s each: the tables
def test_train_py_exits_2_with_one_error_line_and_no_traceback(tmp_path, export, case):  # above run in-process
    out = tmp_path / "run"
    config = FAST
    if case == "batch_size":
        args, fragments = ["data.batch_size=0"], ["data.batch_size=0", ">= 1"]
    elif case == "latin-1 data file":
        (tmp_path / "calc.jsonl").write_bytes(TWO_ROWS.encode() + '{"prompt": "Qué?\n", "response": "A"}\n'.encode("latin-1"))
        config, args = TEXT, [f"experts.0.data=[{tmp_path / 'calc.jsonl'}]"]
        fragments = [f"{tmp_path / 'calc.jsonl'} line 3: not UTF-8 text (byte 0xe9 at byte 15 of the line)"]
    else:
        args = compose_with(damaged_copy(export, tmp_path / "export", "flip"), export.parent / "background")
        fragments = ["composition.compose_with", "adapter_model.safetensors", "sha256 mismatch"]
    before = tree(tmp_path)
    proc = train(str(config), f"output_dir={out}", *args)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert all(f in lines[0] for f in fragments), lines[0]
    assert "Traceback" not in proc.stderr + proc.stdout and proc.stdout == ""
    assert not out.exists() and tree(tmp_path) == before
