"""Data: the generic pieces and the tasks.

Generic pieces (they import neither `compose` nor `lightning_modules`): `collate` (padding, prefix corruption),
`splits` (seeded disjoint splits), `sampler` (the resumable row order), `tokenizer` (a character tokenizer for
synthetic tasks, and loading a user's tokenizer folder), `rows` (reading a data file's rows, each named by its
line or row), `generation` (greedy decoding of prompts), `datamodule` (the one LightningDataModule, over any
task). Tasks: `data.tasks` (`letters`, `intervals`, `features`, `text`), each a `data.tasks.Task` registered by
name in `data.tasks.TASKS`. Nothing is imported here, so importing one piece loads no other.
"""
