"""Evaluation split over the ranks of a distributed run: torch.distributed only (no Lightning).

When a process group of W > 1 ranks is initialized, every rank runs the same evaluation in step (the pipeline's
ranks do: `lightning_modules.pipeline.ranks`). Greedy decoding, the long part, is then split by rows:
`RowSharded(model).generate` decodes rows `r, r + W, ...` of each batch on rank `r` and gathers the outputs on
every rank, so each rank's task computes its metrics on all the outputs; `compose.evaluation.teacher_forced_metrics`
scores rows `r, r + W, ...` and lets its torchmetrics reduce across the ranks. Without a process group (or with
one rank) both are the plain single-process computation.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor


def rank_and_world() -> tuple[int, int]:
    """`(rank, world size)` of the initialized default process group, `(0, 1)` without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


# Set by the launchers for every rank: Lightning's subprocess launcher (LOCAL_RANK, NODE_RANK), torchrun (RANK).
_RANK_ENV = ("RANK", "LOCAL_RANK", "NODE_RANK")
T = TypeVar("T")


def is_leader() -> bool:
    """Whether this process is global rank 0 (also: the only process of a single-process run). Before the process
    group exists, the launcher's rank variables say."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return all(os.environ.get(key, "0") == "0" for key in _RANK_ENV)


def barrier() -> None:
    """Wait for every rank (nothing to wait for in a single process or before the ranks have met)."""
    if rank_and_world()[1] > 1:
        dist.barrier()


def agree(decide: Callable[[], T]) -> T:
    """Rank 0's `decide()`, on every rank (the others do not call it); `decide()` itself in a single process."""
    rank, world = rank_and_world()
    if world == 1:
        return decide()
    box = [decide() if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def sharded(model: Any) -> Any:
    """`model` with its greedy decoding split over the ranks (`RowSharded`) when there are several, else `model`."""
    return RowSharded(model) if rank_and_world()[1] > 1 else model


def all_reduce_max(value: Tensor) -> Tensor:
    """The elementwise maximum of `value` over the ranks (`value` itself in a single process)."""
    if rank_and_world()[1] > 1:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value


class RowSharded:
    """A `ComposedLM` whose greedy `generate` is split by rows over the ranks of the default process group.

    Rank `r` decodes rows `r, r + W, ...` of the batch it is given (the same batch on every rank), and the outputs
    are gathered on every rank in the batch's order, right-padded with the pad id to the longest (a row is padded
    after its EOS, as one process decoding the whole batch pads it). Sampling and explicit `gates` (state per row
    of the whole batch) decode the whole batch on every rank. Every other attribute, read or set, is the model's.
    """

    def __init__(self, model: Any) -> None:
        object.__setattr__(self, "_model", model)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._model, name, value)

    @torch.no_grad()
    def generate(self, input_ids: Tensor, attention_mask: Tensor | None = None, **kwargs: Any) -> Tensor:
        model = self._model
        rank, world = rank_and_world()
        if world == 1 or kwargs.get("do_sample") or kwargs.get("gates") is not None:
            return model.generate(input_ids, attention_mask, **kwargs)
        rows = slice(rank, None, world)
        local = None
        if input_ids[rows].shape[0]:
            mask = None if attention_mask is None else attention_mask[rows]
            local = model.generate(input_ids[rows], mask, **kwargs).cpu()
        parts: list[Tensor | None] = [None] * world
        dist.all_gather_object(parts, local)
        width = max(part.shape[1] for part in parts if part is not None)
        _, pad = model._special_tokens(kwargs.get("eos_token_id"), kwargs.get("pad_token_id"), torch.device("cpu"))
        if pad is None and any(part is not None and part.shape[1] != width for part in parts):
            raise RuntimeError("ranks decoded outputs of different lengths and there is no pad id to align them")
        out = torch.full((input_ids.shape[0], width), int(pad) if pad is not None else 0, dtype=torch.long)
        for r, part in enumerate(parts):
            if part is not None:
                out[r::world, : part.shape[1]] = part
        return out.to(model.device)
