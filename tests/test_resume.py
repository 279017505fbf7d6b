"""Crash anywhere, lose nothing: a run killed at any moment resumes (`ckpt_path=last`) to the summary of an
uninterrupted run of the same seed. The pieces (data order, atomic writes, the config check, logs) are tested
here fast; `test_killed_run_resumes_to_the_uninterrupted_summary` kills real runs (slow)."""

from __future__ import annotations

import csv
import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from omegaconf import OmegaConf

from compose.atomic import atomic_file, atomic_save, pause_point, remove_stale_temporaries
from data.datamodule import TaskDataModule
from data.sampler import ResumableSampler
from data.tasks import Expert
from data.tasks.letters import LettersConfig, LettersTask
from lightning_modules.pipeline.config import ConfigError, load_config
from lightning_modules.pipeline.resume import AtomicCheckpointIO, ResumableCSVLogger, check_resume

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ROOT / "configs" / "default.yaml"
FAST = ROOT / "configs" / "debug" / "fast.yaml"


def letters_task() -> LettersTask:
    experts = [Expert("ab", {"rules": {"A": "B"}}), Expert("cd", {"rules": {"C": "D"}})]
    return LettersTask(LettersConfig(n_train=40, n_val=8, n_test=8, min_len=4, max_len=8), experts,
                       reg_data="composition")


def batches(loader, n: int) -> list[torch.Tensor]:
    """The first `n` batches of a training loader, taken as Lightning does: one `iter` per epoch, to its end."""
    out = []
    while len(out) < n:
        out += [b["input_ids"] for b in loader]
    return out[:n]


def train_loader(task: LettersTask, batches_trained: int = 0):
    loader = TaskDataModule(task, "experts", batch_size=12, corruption_prob=0.5, seed=3).train_dataloader()
    loader.load_state_dict({"batches": batches_trained})  # what a checkpoint after that many steps holds
    return loader


def test_training_batches_resume_exactly_at_any_step():
    task = letters_task()
    full = batches(train_loader(task), 30)  # 160 rows / 12: 14 batches an epoch, so two epoch boundaries
    assert len({tuple(b.flatten().tolist()) for b in full}) == 30  # each epoch in its own order
    for g in (1, 13, 14, 15, 29):
        torch.manual_seed(1234 + g)  # whatever the global RNG holds: corruption does not draw from it
        resumed = batches(train_loader(task, g), 30 - g)
        assert all(torch.equal(a, b) for a, b in zip(resumed, full[g:], strict=True)), g


def test_an_iteration_that_never_started_does_not_advance_the_epoch():
    sampler = ResumableSampler(10, seed=0)
    sampler.resume(0, 7)
    iter(sampler)  # (Lightning calls iter once more on a resumed epoch)
    assert [k[1] for k in sampler] == [7, 8, 9]
    assert [k[0] for k in sampler] == [1] * 10  # the next epoch, whole


def test_ranks_share_each_epoch_between_them():
    ranks = [ResumableSampler(11, seed=0, label="x", num_replicas=3, rank=r) for r in range(3)]
    keys = [list(s) for s in ranks]
    assert [len(k) for k in keys] == [4, 4, 4]  # padded to 12, as DistributedSampler pads
    rows = sorted(row for k in keys for _, _, row in k)
    assert set(rows) == set(range(11)) and len(rows) == 12
    assert sorted(pos for k in keys for _, pos, _ in k) == list(range(12))


def test_stale_temporaries_of_interrupted_saves_are_removed(tmp_path):
    keep = [tmp_path / "export" / "composition.yaml", tmp_path / ".hidden", tmp_path / "a.tmp-1234"]
    stale = [tmp_path / ".export.tmp-8dbcaa22" / "background" / "config.json",
             tmp_path / "checkpoints" / "experts" / ".last.ckpt.tmp-0a1b2c3d",
             tmp_path / "ablations" / "plain_k2" / ".background.old-deadbeef" / "model.safetensors",
             tmp_path / ".summary.json.tmp-4242"]
    for p in keep + stale:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("x")
    removed = remove_stale_temporaries(tmp_path)
    assert {p.name for p in removed} == {".export.tmp-8dbcaa22", ".last.ckpt.tmp-0a1b2c3d",
                                         ".background.old-deadbeef", ".summary.json.tmp-4242"}
    assert all(p.exists() for p in keep)
    assert not any(p.name.startswith(".") and (".tmp-" in p.name or ".old-" in p.name)
                   for p in tmp_path.rglob("*") if p.name != ".hidden")


def test_atomic_writes_leave_the_old_file_or_folder_when_interrupted(tmp_path):
    target = tmp_path / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint({"global_step": 3}, target)
    with pytest.raises(RuntimeError), atomic_file(target) as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError("killed")
    assert torch.load(target, weights_only=True) == {"global_step": 3}

    def half(tmp: Path) -> None:
        tmp.mkdir()
        (tmp / "config.json").write_text("{")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_save(half, tmp_path / "background")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_pause_point_does_nothing_unless_named(monkeypatch, capsys):
    monkeypatch.setenv("COMPOSABLE_EXPERTS_PAUSE_AT", "run/experts step 3")
    pause_point("run/experts step 2")
    monkeypatch.delenv("COMPOSABLE_EXPERTS_PAUSE_AT")
    pause_point("run/experts step 3")
    assert capsys.readouterr().out == ""


def test_resumed_logger_keeps_the_rows_before_where_it_starts_again(tmp_path):
    first = ResumableCSVLogger(tmp_path, name="experts", version="")
    for step in range(6):
        first.log_metrics({"train/loss": float(step)}, step=step)
    first.log_metrics({"val/nll": 9.0}, step=5)
    first.log_hyperparams({"lr": 0.1})
    first.save()
    again = ResumableCSVLogger(tmp_path, name="experts", version="")  # resumed from the checkpoint at step 4
    for step in range(4, 8):
        again.log_metrics({"train/loss": 10.0 + step, "val/acc": 1.0}, step=step)
    again.save()
    with open(tmp_path / "experts" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["step"], r["train/loss"]) for r in rows] == [
        ("0", "0.0"), ("1", "1.0"), ("2", "2.0"), ("3", "3.0"), ("4", "14.0"), ("5", "15.0"), ("6", "16.0"),
        ("7", "17.0")]
    assert set(rows[0]) == {"step", "train/loss", "val/nll", "val/acc"}
    assert yaml.safe_load((tmp_path / "experts" / "hparams.yaml").read_text()) == {"lr": 0.1}
    assert sorted(p.name for p in (tmp_path / "experts").iterdir()) == ["hparams.yaml", "metrics.csv"]


def test_expert_checkpoints_hold_the_trained_state_and_load_into_a_fresh_module():
    from tiny_models import tiny_model

    from lightning_modules.expert import ExpertLM, ExpertSettings

    def build() -> ExpertLM:
        return ExpertLM(tiny_model(), ["a", "b_1"], ExpertSettings(lora_r=2))

    module = build()
    trained = {n for n, p in module.named_parameters() if p.requires_grad}
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name in trained:
                p.normal_()  # (lora_B starts at zero)
    module.peft_model.set_adapter("a")  # peft freezes the adapters it does not activate: still trained state
    checkpoint = {"state_dict": module.state_dict()}
    module.on_save_checkpoint(checkpoint)
    assert set(checkpoint["state_dict"]) == trained and all(".lora_" in k for k in trained)
    assert {k.split(".lora_")[1].split(".", 1)[1] for k in trained} == {"a.weight", "b_1.weight"}
    fresh = build()
    fresh.load_state_dict(checkpoint["state_dict"])
    assert all(torch.equal(v, fresh.state_dict()[k]) for k, v in module.state_dict().items())
    with pytest.raises(RuntimeError, match="Missing key"):  # a trained weight missing is still an error
        fresh.load_state_dict({k: v for k, v in checkpoint["state_dict"].items() if ".b_1." not in k})


def test_a_checkpoint_refuses_another_background(tmp_path):
    from safetensors.torch import save_file

    from lightning_modules.callbacks import CheckpointBackgroundError, FrozenBackgroundCheck

    folder = tmp_path / "background"
    folder.mkdir()
    save_file({"w": torch.zeros(3)}, folder / "model.safetensors")
    checkpoint: dict = {}
    FrozenBackgroundCheck(folder).on_save_checkpoint(None, None, checkpoint)
    FrozenBackgroundCheck(folder).verify(checkpoint)
    save_file({"w": torch.ones(3)}, folder / "model.safetensors")
    with pytest.raises(CheckpointBackgroundError, match=r"SHA-256 model\.safetensors differ"):
        FrozenBackgroundCheck(folder).verify(checkpoint)


def _saved_run(tmp_path: Path, *overrides: str) -> Path:
    out = tmp_path / "run"
    (out / "checkpoints" / "background").mkdir(parents=True)
    (out / "checkpoints" / "background" / "last.ckpt").write_bytes(b"")
    saved = load_config([str(FAST)], [f"output_dir={out}", *overrides], base=DEFAULT)
    (out / "config.yaml").write_text(OmegaConf.to_yaml(saved, resolve=True))
    return out


def resumed(out: Path, *overrides: str):
    return load_config([str(FAST)], [f"output_dir={out}", "ckpt_path=last", *overrides], base=DEFAULT)


def test_resume_with_a_config_that_changes_what_was_trained_is_refused_naming_the_keys(tmp_path):
    out = _saved_run(tmp_path)
    check_resume(resumed(out, "trainer.enable_progress_bar=true", "baselines=[]", "report=false",
                         "expert.lora.r=4"), out)  # presentation, later stages, and experts not begun yet
    check_resume(resumed(out, "trainer.logger=tensorboard", "composition.lm_eval.limit=3"), out)  # what is logged
    with pytest.raises(ConfigError) as err:
        check_resume(resumed(out, "model.hidden_size=48", "model.arch=gpt2", "trainer.enable_progress_bar=true"), out)
    message = str(err.value)
    assert "\n" not in message and "model.hidden_size (32 -> 48)" in message and "model.arch (llama -> gpt2)" in message
    assert "enable_progress_bar" not in message
    for override in ("seed=1", "task.n_train=100", "data.batch_size=8", "background.max_steps=13",
                     "experts.0.weight=2.0", "trainer.precision=bf16-true"):
        with pytest.raises(ConfigError, match=rf"differs in {override.split('=')[0]} \("):
            check_resume(resumed(out, override), out)
    (out / "export").mkdir()  # the experts are trained now
    with pytest.raises(ConfigError, match=r"expert\.lora\.r \(2 -> 4\).*the background and the experts"):
        check_resume(resumed(out, "expert.lora.r=4"), out)


def test_refused_resume_writes_nothing(tmp_path):
    from lightning_modules.pipeline.stages import run

    out = _saved_run(tmp_path)
    (out / ".export.tmp-1234abcd").mkdir()  # not even stale folders are touched
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    with pytest.raises(ConfigError, match="model.hidden_size"):
        run(resumed(out, "model.hidden_size=48"))
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before


# ------------------------------------------------------------------------------------ killed real runs

RUN = [str(FAST), "background.max_steps=40", "expert.max_steps=31", "ablations=[plain]", "ablation_ks=[2]"]
# Where the chain of kills lands, in run order: (pause point | printed line, what it interrupts). Pause
# points (compose.common.pause_point) print `[pause] <point>` and wait there to be killed.
KILLS = [
    ("pause", "run/background step 20", "background training"),
    ("pause", "run/experts step 14", "expert training"),
    ("pause", "run/export", "export writing (the folder written, not yet in place)"),
    ("line", "[composition] decoding the test split: expert", "the composition stage"),
    ("pause", "plain_k2/experts step 10", "an ablation sub-run's expert training"),
]
TIMING = ("timing", "command")  # seconds, and the command line (it says ckpt_path=last)


def _train(out: Path, *extra: str, kill: tuple[str, str] | None = None, run: list[str] = RUN,
           sig: signal.Signals = signal.SIGKILL) -> tuple[int, str]:
    """Run train.py; with `kill`, send `sig` where it says (a pause point or a printed line)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if kill and kill[0] == "pause":
        env["COMPOSABLE_EXPERTS_PAUSE_AT"] = kill[1]
    proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *run, f"output_dir={out}", *extra], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    printed = []
    try:
        for line in proc.stdout:
            printed.append(line)
            if kill and line.startswith(f"[pause] {kill[1]}" if kill[0] == "pause" else kill[1]):
                proc.send_signal(sig)
                if sig == signal.SIGKILL:
                    break
        proc.wait(timeout=600)
    finally:
        proc.kill()
    printed.append(proc.stdout.read())
    proc.stdout.close()
    return proc.returncode, "".join(printed)


def _summary(out: Path) -> dict:
    def clean(x):
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items() if k not in TIMING}
        if isinstance(x, list):
            return [clean(v) for v in x]
        return x.replace(str(out), "<run>") if isinstance(x, str) else x

    return clean(json.loads((out / "summary.json").read_text()))


def _assert_nothing_half_written(out: Path) -> None:
    from safetensors.torch import load_file

    stale = [p for p in out.rglob(".*") if ".tmp-" in p.name or ".old-" in p.name]
    assert not stale, stale
    for p in out.rglob("*"):
        if p.suffix == ".json":
            json.loads(p.read_text())
        elif p.suffix == ".yaml":
            yaml.safe_load(p.read_text())
        elif p.suffix == ".safetensors":
            load_file(p)
        elif p.suffix == ".ckpt":
            torch.load(p, map_location="cpu", weights_only=True, mmap=True)
        elif p.suffix == ".csv":
            with open(p, newline="") as f:
                rows = list(csv.reader(f))
            assert len({len(r) for r in rows}) == 1, p  # every line complete


@pytest.mark.slow
def test_killed_run_resumes_to_the_uninterrupted_summary(tmp_path):
    """Two uninterrupted runs agree; a run killed (SIGKILL) in each stage in turn, resumed each time with
    `ckpt_path=last`, ends with their summary (timings aside), their logs, and no half-written file."""
    reference, again = tmp_path / "reference", tmp_path / "again"
    for out in (reference, again):
        code, printed = _train(out)
        assert code == 0, printed[-3000:]
    assert _summary(reference) == _summary(again)
    assert json.loads((reference / "summary.json").read_text())["composition"]["k"] == 2

    out = tmp_path / "run"
    for mode, point, what in KILLS:
        code, printed = _train(out, *(["ckpt_path=last"] if out.exists() else []), kill=(mode, point))
        assert code == -signal.SIGKILL, f"{what}: the run was not killed there (exit {code})\n{printed[-3000:]}"
        if point.endswith("/export"):
            assert any(out.glob(".export.tmp-*")), "the interrupted export left no temporary folder to clean up"
    code, printed = _train(out, "ckpt_path=last")
    assert code == 0, printed[-3000:]
    assert _summary(out) == _summary(reference)
    for log in ("logs/background", "logs/experts", "ablations/plain_k2/logs/experts"):
        assert (out / log / "metrics.csv").read_text() == (reference / log / "metrics.csv").read_text(), log
    _assert_nothing_half_written(out)


SIGNAL_RUN = [str(FAST), "background.max_steps=12", "expert.max_steps=9", "ablations=[]"]  # validation every 3 steps
# (signal, where, what it interrupts, the step of the stage's last.ckpt after it or None): a training stage
# finishes the step it is in and saves there (not at the last validation); anything else stops at once.
STOPS = [
    (signal.SIGINT, ("pause", "run/background step 5"), "background training (Ctrl-C)", ("background", 5)),
    (signal.SIGTERM, ("pause", "run/experts step 2"), "expert training, before its first validation", ("experts", 2)),
    (signal.SIGTERM, ("line", "[composition] decoding the test split: expert"), "the composition stage", None),
]


@pytest.mark.slow
def test_sigterm_and_sigint_save_say_how_to_resume_and_exit_128_plus_the_signal(tmp_path):
    """SIGINT and SIGTERM in training and after it: exit 130 / 143, one line with the command that resumes (and
    no library line about the signal), the stage's checkpoint at the step reached; resumed, the run ends with
    the summary and logs of an uninterrupted one."""
    from lightning_modules.pipeline.resume import last_step

    reference, out = tmp_path / "reference", tmp_path / "run"
    code, printed = _train(reference, run=SIGNAL_RUN)
    assert code == 0, printed[-3000:]
    for sig, where, what, saved in STOPS:
        code, printed = _train(out, *(["ckpt_path=last"] if out.exists() else []), kill=where, run=SIGNAL_RUN, sig=sig)
        assert code == 128 + sig, f"{what}: exit {code}\n{printed[-3000:]}"
        said = [line for line in printed.splitlines() if line.startswith("stopped by")]
        again = shlex.join(["python", "train.py", *SIGNAL_RUN, f"output_dir={out}", "ckpt_path=last"])
        assert said == [f"stopped by {sig.name}; what it needs to resume is saved: {again}"], printed[-3000:]
        assert "Traceback" not in printed and "Received SIGTERM" not in printed, printed[-3000:]
        if saved:
            assert last_step(out / "checkpoints" / saved[0] / "last.ckpt") == saved[1], what
    state = torch.load(out / "checkpoints" / "experts" / "last.ckpt", map_location="cpu", weights_only=True)
    assert all(".A_to_B." in k or ".C_to_D." in k for k in state["state_dict"])  # no frozen background weight
    assert state["frozen_background"]["folder"] == str((out / "background").resolve())
    code, printed = _train(out, "ckpt_path=last", run=SIGNAL_RUN)
    assert code == 0, printed[-3000:]
    assert _summary(out) == _summary(reference)
    for log in ("logs/background", "logs/experts"):
        assert (out / log / "metrics.csv").read_text() == (reference / log / "metrics.csv").read_text(), log
    _assert_nothing_half_written(out)
    assert not list(out.rglob("last-v*.ckpt"))  # one last.ckpt per stage, the one a resume reads
