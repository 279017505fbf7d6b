"""Distributed on Lightning's engine: `train.py` under `trainer.strategy=ddp` on 2 CPU processes.

The slow tests run configs/trainer/ddp.yaml (with `accelerator=cpu`, `devices=2`, `precision=32-true`: gloo) on
the fast config, trained long enough that the experts move the composition, once on two ranks and once in a single
process. Batch: `data.batch_size` is per rank (Lightning's convention), so the DDP run is given half of the single
run's (16 x 2 ranks = 32); the rows of its step n on the two ranks are then exactly the single run's step-n rows
(`data.sampler`). Prefix corruption is off in these runs: it is drawn per batch (`SeededCollate`), so each rank
would corrupt its half otherwise than the single run corrupts the whole, and that noise alone moves the composed NLL
by 16% and the off-mask KL by up to 46% between two single runs (measured, seed 0, with only the corruption
seeds salted). Without it the runs differ only in
the order of the gradient reductions. Measured (seed 0): composed NLL 1.2% apart, each expert's on-mask KL at most 2%,
off-mask KL at most 9%.

Checked: one run folder (timestamped, no output_dir) with the files of a single-process run and nothing else in the
working folder; rank 1 ran and wrote nothing under it (a `sitecustomize` audit hook records its Python-level
writes); every metric the run reports (validation of the background, of each expert and of the composition, and
the final test-split composition) equals a single-process computation on the run's own final model (reduced across
the ranks, not one rank's half); the export loads and composes like the single run's within TOLERANCE.
"""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_modules.pipeline.config import load_config

ROOT = Path(__file__).resolve().parents[1]
FAST = ROOT / "configs" / "debug" / "fast.yaml"
DDP_CPU = [ROOT / "configs" / "trainer" / "ddp.yaml", "trainer.accelerator=cpu", "trainer.devices=2",
           "trainer.precision=32-true"]
# Long enough that the experts change the composition (on-mask KL 4-5 nats), short enough for CI; every
# validation falls on a multiple of 30 steps, the last one on each stage's final model.
SETUP = [FAST, "background.max_steps=180", "expert.max_steps=60", "trainer.val_check_interval=30", "ablations=[]",
         "baselines=[]", "background.corruption_prob=0", "expert.corruption_prob=0"]
# How close the DDP run's export composes to the single run's (relative): teacher-forced NLL of the composition,
# and each expert's off/on-mask KL inside it. Untrained experts (on-mask KL ~0) or a broken background fail.
TOLERANCE = {"nll": 0.05, "kl": 0.25}

# In a process started as rank > 0 (LOCAL_RANK set at start), record every Python-level write (open for writing,
# mkdir, rename/replace, remove, ...) under $AUDIT_RUN_DIR; every file the pipeline writes goes through one.
AUDIT = '''
import os, sys
root, log = os.environ.get("AUDIT_RUN_DIR"), os.environ.get("AUDIT_LOG")
if root and log and os.environ.get("LOCAL_RANK", "0") != "0":
    root = os.path.realpath(root)
    WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    EVENTS = {"os.mkdir", "os.rename", "os.replace", "os.remove", "os.rmdir", "shutil.rmtree", "os.symlink",
              "os.link", "os.truncate", "os.chmod", "os.utime"}

    def hook(event, args):
        if event == "open":
            path, mode, flags = args
            writing = bool(isinstance(flags, int) and flags & WRITE) or any(c in str(mode or "") for c in "wax+")
        elif event in EVENTS:
            path, writing = args[0], True
        else:
            return
        if writing and isinstance(path, (str, bytes, os.PathLike)):
            full = os.path.realpath(os.fsdecode(path))
            if full == root or full.startswith(root + os.sep):
                with open(log, "a") as f:
                    f.write(f"{event} {full}\\n")

    open(f"{log}.started-{os.getpid()}", "w").close()
    sys.addaudithook(hook)
'''


def train(*args, cwd=ROOT, env=None, timeout=600):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(single-process run folder, DDP run folder, the DDP process, its working folder, the audit log)."""
    tmp = tmp_path_factory.mktemp("distributed")
    single = tmp / "single"
    proc = train(*SETUP, f"output_dir={single}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    hooks, cwd, audit = tmp / "hooks", tmp / "cwd", tmp / "audit.log"
    hooks.mkdir()
    cwd.mkdir()
    (hooks / "sitecustomize.py").write_text(AUDIT)
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(hooks), os.environ.get("PYTHONPATH")])),
           "AUDIT_RUN_DIR": str(cwd), "AUDIT_LOG": str(audit)}
    # No output_dir: rank 0 picks runs/<experiment>/<timestamp> and every rank must use that one folder.
    proc = train(*DDP_CPU, *SETUP, "data.batch_size=16", cwd=cwd, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    folders = list((cwd / "runs" / "debug_fast").iterdir())
    assert len(folders) == 1, folders
    return single, folders[0], proc, cwd, audit


def _files(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


@pytest.mark.slow
def test_ddp_run_finishes_in_one_folder_that_rank_0_alone_writes(runs):
    single, ddp, proc, cwd, audit = runs
    assert [p.name for p in cwd.iterdir()] == ["runs"]  # no lightning_logs/, no second run folder
    assert _files(ddp) == _files(single)  # the same files as a single-process run, no temporaries left
    started = list(audit.parent.glob(audit.name + ".started-*"))
    assert len(started) == 1  # rank 1 ran (Lightning's launcher started train.py again) ...
    assert not audit.exists(), audit.read_text()[:2000]  # ... and wrote nothing under the working folder
    assert proc.stdout.count("| component | exact match |") == 1  # one summary: rank 1 prints nothing
    assert "Traceback" not in proc.stderr
    summary = json.loads((ddp / "summary.json").read_text())
    assert summary["output_dir"] == str(ddp.relative_to(cwd)) and summary["export"].endswith("export")


def _task(run: Path):
    from data.tasks import Expert, task_class
    from lightning_modules.pipeline.config import expert_spec, task_settings

    cfg = load_config([str(run / "config.yaml")])
    experts = [Expert(e.name, expert_spec(e), float(e.weight)) for e in cfg.experts]
    task = task_class(cfg.task.name)(task_settings(cfg), experts, reg_data=cfg.expert.reg_data, seed=cfg.seed)
    return cfg, task


def _last_logged(run: Path, stage: str, key: str) -> tuple[int, float]:
    """(step, value) of the last row of `logs/<stage>/metrics.csv` that holds `key`."""
    with open(run / "logs" / stage / "metrics.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get(key)]
    return int(rows[-1]["step"]), float(rows[-1][key])


@pytest.mark.slow
def test_ddp_metrics_are_reduced_over_both_ranks(runs):
    """Each metric of the DDP run equals one process computing it on all the rows with the run's final model."""
    from compose import ComposedLM
    from data.datamodule import TaskDataModule
    from lightning_modules.background import BackgroundLM
    from lightning_modules.pipeline.models import load_pretrained
    from lightning_modules.pipeline.stages import Plan, expert_module

    _, run, _, _, _ = runs
    cfg, task = _task(run)
    close = dict(rel=1e-4, abs=1e-6)
    # the final test-split composition (summary.json): decoded and scored in shares, reduced across the ranks
    summary = json.loads((run / "summary.json").read_text())
    export = ComposedLM.from_manifest(run / "export")
    expected = task.composition_metrics(export, task.compositional_dataset("test"), 32)
    for key in ("exact_match", "nll", "projectivity_error", "margin_on_mask_below_0", "margin_off_mask_below_2"):
        assert summary["composition"][key] == pytest.approx(expected[key], **close), key
    for kind, fraction in summary["composition"]["failures"].items():
        if not kind.endswith("_ci95"):  # summary.json adds each fraction's 95 % interval
            assert fraction == pytest.approx(expected[f"failures/{kind}"], **close), kind
    for name in ("A_to_B", "C_to_D"):
        for key in ("off_mask_kl", "on_mask_kl", "max_off_mask_log_ratio", "skill_accuracy", "active_recall"):
            assert summary["experts"][name][key] == pytest.approx(expected[f"{name}/{key}"], **close), (name, key)

    # validation of the composition (the callback) at the last step: the first val_limit compositional val rows
    comp_val = task.compositional_dataset("val").select(range(cfg.composition.val_limit))
    expected = task.composition_metrics(export, comp_val, 32)
    for key in ("nll", "exact_match", "A_to_B/off_mask_kl", "C_to_D/skill_accuracy", "projectivity_error"):
        step, value = _last_logged(run, "experts", f"val/composed/{key}")
        assert step == cfg.expert.max_steps - 1 and value == pytest.approx(expected[key], **close), key

    # validation of each expert on its own rows (ExpertLM's torchmetrics), from the final checkpoint
    module = expert_module(cfg, Plan(run, task, ["A_to_B", "C_to_D"], []), run / "background")
    module.load_state_dict(torch.load(run / "checkpoints/experts/last.ckpt", weights_only=True)["state_dict"])
    module.eval()
    loader = TaskDataModule(task, "experts", 64).val_dataloader()
    with torch.no_grad():
        for i, batch in enumerate(loader):
            module.validation_step(batch, i)
    for name in ("A_to_B", "C_to_D"):
        values = {"off_mask_kl": module.val_off_mask_kl[name].compute(), "nll": module.val_nll[name].compute(),
                  "on_mask_kl": module.val_on_mask_kl[name].compute(),
                  "active_recall": module.val_active[name].compute()["recall"]}
        for key, value in values.items():
            _, logged = _last_logged(run, "experts", f"val/{name}/{key}")
            assert logged == pytest.approx(float(value), **close), (name, key)

    # validation of the background (torchmetrics MeanMetric), from the saved background
    background = BackgroundLM(load_pretrained(run / "background")).eval()
    with torch.no_grad():
        for i, batch in enumerate(TaskDataModule(task, "background", 32).val_dataloader()):
            background.validation_step(batch, i)
    for key, metric in (("nll", background.val_nll), ("teacher_forced_exact_match", background.val_exact_match)):
        step, logged = _last_logged(run, "background", f"val/{key}")
        assert step == cfg.background.max_steps - 1 and logged == pytest.approx(float(metric.compute()), **close)


@pytest.mark.slow
def test_ddp_experts_compose_like_a_single_process_runs(runs):
    from compose import ComposedLM

    single, ddp, _, _, _ = runs
    _, task = _task(single)
    test = task.compositional_dataset("test")
    a, b = (task.composition_metrics(ComposedLM.from_manifest(run / "export"), test, 32) for run in (single, ddp))
    assert b["nll"] == pytest.approx(a["nll"], rel=TOLERANCE["nll"])
    for name in ("A_to_B", "C_to_D"):
        assert a[f"{name}/on_mask_kl"] > 1.0  # the experts moved the composition (measured: 4.5-5.3 nats)
        for key in ("off_mask_kl", "on_mask_kl"):
            assert b[f"{name}/{key}"] == pytest.approx(a[f"{name}/{key}"], rel=TOLERANCE["kl"]), (name, key)


@pytest.mark.slow
def test_ddp_run_killed_in_expert_training_resumes_to_the_uninterrupted_summary(tmp_path):
    """Both ranks pick up from rank 0's last checkpoint (its step, each rank's share of the rows that follow)."""
    setup = [*DDP_CPU, FAST, "background.max_steps=20", "expert.max_steps=12", "ablations=[]", "baselines=[]"]
    reference, out = tmp_path / "reference", tmp_path / "run"
    proc = train(*setup, f"output_dir={reference}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", COMPOSABLE_EXPERTS_PAUSE_AT="run/experts step 5")
    # its own process group: the kill reaches rank 1 too (it waits at the same pause point)
    killed = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *map(str, setup), f"output_dir={out}"],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)
    try:
        for line in killed.stdout:
            if line.startswith("[pause] run/experts step 5"):
                break
    finally:
        os.killpg(killed.pid, signal.SIGKILL)
        killed.wait(timeout=60)
        killed.stdout.close()
    assert (out / "checkpoints/experts/last.ckpt").is_file() and not (out / "export").exists()
    proc = train(*setup, f"output_dir={out}", "ckpt_path=last")
    assert proc.returncode == 0, proc.stderr[-3000:]

    def summary(run: Path) -> dict:
        s = json.loads((run / "summary.json").read_text())
        return {k: v for k, v in s.items() if k not in ("timing", "command", "output_dir", "export")}

    assert summary(out) == summary(reference)
    for log in ("background", "experts"):
        assert (out / "logs" / log / "metrics.csv").read_text() == (reference / "logs" / log / "metrics.csv").read_text()


def test_fsdp_on_cpu_is_one_config_error_naming_the_accelerator(tmp_path):
    out = tmp_path / "run"
    for args in ([FAST, "trainer.strategy=fsdp"], [ROOT / "configs/trainer/fsdp.yaml", FAST, "trainer.accelerator=cpu",
                                                    "trainer.devices=2", "trainer.precision=32-true"]):
        proc = train(*args, f"output_dir={out}", timeout=120)
        assert proc.returncode == 2, proc.stderr[-2000:]
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "trainer.strategy=fsdp needs trainer.accelerator=gpu" in lines[0], proc.stderr
        assert not out.exists()


def test_ranks_share_each_step_of_a_single_process_run_and_resume_together():
    """Rank r's batch n holds rows r, r + W, ... of the single-process batch n (per-rank batch = B / W), also when
    every rank resumes from a checkpoint's batch count."""
    from data.sampler import ResumableLoader

    class Keep:  # a collator that returns the rows (SeededCollate sets its generator)
        generator = None

        def __call__(self, rows):
            return [r["i"] for r in rows]

    rows = [{"i": i} for i in range(40)]
    single = ResumableLoader(rows, Keep(), batch_size=8, seed=3, label="experts")
    ranks = [ResumableLoader(rows, Keep(), batch_size=4, seed=3, label="experts", num_replicas=2, rank=r)
             for r in range(2)]

    def take(loader, n):
        it, out = iter(loader), []
        while len(out) < n:
            try:
                out.append(next(it))
            except StopIteration:  # the next epoch
                it = iter(loader)
        return out

    expected = take(single, 12)  # 5 batches an epoch: two epoch boundaries
    shares = [take(loader, 12) for loader in ranks]
    for n, batch in enumerate(expected):
        assert shares[0][n] == batch[0::2] and shares[1][n] == batch[1::2], n
    for g in (3, 5, 7):
        for loader in ranks:
            loader.load_state_dict({"batches": g})
        resumed = [take(loader, 12 - g) for loader in ranks]
        assert resumed == [[batch[r::2] for batch in expected[g:]] for r in range(2)], g


def test_the_regularizer_disables_the_adapters_of_the_wrapped_model(tmp_path):
    """Under a DDP wrapper around the PeftModel (the case of a strategy that wraps it), `background_logits` is the
    background's (adapters off on the PeftModel inside) and the forward still goes through the wrapper."""
    import torch.distributed as dist
    from tiny_models import tiny_model
    from torch.nn.parallel import DistributedDataParallel

    from lightning_modules.expert import ExpertLM, ExpertSettings

    background, reference = tiny_model("llama", seed=0), tiny_model("llama", seed=0)
    module = ExpertLM(background, ["a", "b"], ExpertSettings(lora_r=2, lora_alpha=4))
    with torch.no_grad():
        for name, p in module.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)  # adapters that change the output
    ids = torch.randint(3, 20, (2, 7))
    attn = torch.ones_like(ids)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        module.model = DistributedDataParallel(module.model)
        calls = []
        module.model.register_forward_pre_hook(lambda *_: calls.append(1))
        assert module.peft_model is module.model.module
        bg = module.background_logits(ids, attn)
        assert calls == [1]  # through the wrapper
        expected = reference(input_ids=ids, attention_mask=attn).logits
        assert torch.allclose(bg, expected, atol=1e-5)
        expert = module.expert_logits(ids, attn, torch.tensor([0, 1]))
        assert not torch.allclose(expert, expected, atol=1e-2)  # the adapters are on again
        assert all(p.requires_grad for n, p in module.model.named_parameters() if "lora_" in n)
    finally:
        dist.destroy_process_group()
