"""Who does what when Lightning runs the pipeline on several processes (`trainer.strategy=ddp`).

Lightning's `ddp` strategy starts ranks 1..W-1 at rank 0's first `fit` by running `train.py` again with the same
arguments (its subprocess launcher), `LOCAL_RANK`, `NODE_RANK` and `WORLD_SIZE` in their environment. Every rank
then runs the whole pipeline in step, the same stages, fits and evaluations in the same order, so that each
collective (DDP's gradient reduction, torchmetrics' `compute`, the sharded decoding of `compose.distributed`) is
entered by all of them; only rank 0 writes:

* The run folder is rank 0's: it resolves it (a timestamped one too) and checks it before a rank > 0 exists, and
  hands it on in `$COMPOSABLE_EXPERTS_OUTPUT_DIR`; a rank > 0 neither checks, creates nor writes it (Lightning's
  loggers and checkpoints are written by rank 0 alone as well).
* What rank 0 writes and the others then read (the background folder) is followed by `barrier()`.
* Decisions taken from the run folder's files once the ranks have met (which checkpoint a stage resumes from,
  whether a stage or a sub-run is finished) are rank 0's (`agree`): the others would read files rank 0 may be
  writing. Before the ranks meet, rank 0 waits in its first `fit` and changes none of the files they read.
* A rank > 0 prints nothing on stdout (`train.py`); its warnings and errors reach stderr.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist

OUTPUT_DIR_ENV = "COMPOSABLE_EXPERTS_OUTPUT_DIR"
# Set by the launchers for every rank: Lightning's subprocess launcher (LOCAL_RANK, NODE_RANK), torchrun (RANK).
_RANK_ENV = ("RANK", "LOCAL_RANK", "NODE_RANK")

T = TypeVar("T")


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def is_leader() -> bool:
    """Whether this process is global rank 0 (also: the only process of a single-process run)."""
    if _initialized():
        return dist.get_rank() == 0
    return all(os.environ.get(key, "0") == "0" for key in _RANK_ENV)


def barrier() -> None:
    """Wait for every rank (nothing to wait for in a single process or before the ranks have met)."""
    if _initialized() and dist.get_world_size() > 1:
        dist.barrier()


def agree(decide: Callable[[], T]) -> T:
    """Rank 0's `decide()`, on every rank (the others do not call it); `decide()` itself in a single process."""
    if not (_initialized() and dist.get_world_size() > 1):
        return decide()
    box = [decide() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]
