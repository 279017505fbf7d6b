"""The background's own continuations as regularizer rows (`expert.reg_data: own+samples`).

An expert regularized on text the background itself writes learns to stay on the background wherever the
background would go, with no row written by anyone else. The continuations of the task's general prompts
(`Task.background_sample_prompts`) are sampled once per background and cached as JSON under the cache root
(`pipeline.models.cache_root`), keyed by the background's weight checksums, the prompt ids and the sampling
settings (`expert.reg_samples`, the run's seed): every later run, and every expert trained apart on the same
background, reads the same file.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from compose import ComposedLM
from compose.atomic import atomic_write_text
from compose.distributed import barrier, is_leader
from data.generation import decode_until_eos, left_padded
from data.tasks import Task
from lightning_modules.pipeline.models import cache_root, file_sha256, load_pretrained

SAMPLES_DIR = "background_samples"


def background_checksums(folder: Path) -> dict[str, str]:
    """SHA-256 of each weight file of an HF folder (`*.safetensors`), by file name."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors weights to key the background samples by")
    return {f.name: file_sha256(f) for f in files}


def samples_path(checksums: dict[str, str], prompts: Sequence[Sequence[int]], settings: dict[str, Any],
                 root: Path | None = None) -> Path:
    """The cache file of one background, prompt list and sampling settings."""
    key = json.dumps({"background": checksums, "prompts": [list(p) for p in prompts], "settings": settings},
                     sort_keys=True)
    return (root or cache_root()) / SAMPLES_DIR / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"


@torch.no_grad()
def sample_continuations(model: ComposedLM, prompts: Sequence[Sequence[int]], settings: dict[str, Any]) -> list[str]:
    """One sampled continuation per prompt (text up to EOS or the budget), reproducible from `settings["seed"]`."""
    tok = model.tokenizer
    eos, pad = tok.eos_token_id, tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    generator = torch.Generator(device=model.device).manual_seed(settings["seed"])
    out, size = [], settings["batch_size"]
    for start in range(0, len(prompts), size):
        ids, attn = left_padded(prompts[start:start + size], pad)
        gen = model.generate(ids.to(model.device), attn.to(model.device), max_new_tokens=settings["max_new_tokens"],
                             do_sample=True, temperature=settings["temperature"], top_p=settings["top_p"],
                             eos_token_id=eos, pad_token_id=pad, generator=generator)
        out += [text for text, _ in decode_until_eos(tok, gen.cpu(), ids.shape[1], eos)]
    return out


def draw_background_samples(cfg: DictConfig, task: Task, background_path: Path, root: Path | None = None) -> Path | None:
    """Give `task` the background's samples for its regularizer rows (drawn on the first call, read from the
    cache after); returns the cache file, or None when the task asks for none."""
    prompts = task.background_sample_prompts()
    if not prompts:
        return None
    s = cfg.expert.reg_samples
    settings = {"temperature": float(s.temperature), "top_p": float(s.top_p), "seed": int(cfg.seed),
                "max_new_tokens": int(s.max_new_tokens or cfg.task.max_new_tokens), "batch_size": int(s.batch_size)}
    path = samples_path(background_checksums(Path(background_path)), prompts, settings, root)
    if is_leader() and not path.is_file():
        model = ComposedLM(load_pretrained(background_path, task.tokenizer).eval(), tokenizer=task.tokenizer)
        print(f"[experts] sampling the background's continuations of {len(prompts)} general prompts -> {path}")
        texts = sample_continuations(model, prompts, settings)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps({"settings": settings, "responses": texts}))
    barrier()
    task.set_background_samples(json.loads(path.read_text())["responses"])
    return path
