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

The helpers (`is_leader`, `barrier`, `agree`) are `compose.distributed`'s.
"""

from __future__ import annotations

OUTPUT_DIR_ENV = "COMPOSABLE_EXPERTS_OUTPUT_DIR"
