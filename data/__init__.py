"""Data: the generic pieces and the tasks.

Framework: `collate` (padding, prefix corruption), `splits` (seeded disjoint splits), `intervals` (masks
from interval specs, stopping-time detectors), `tokenizer` (a character tokenizer for synthetic tasks),
`datamodule` (the one LightningDataModule, over any task). Tasks: `data/tasks/` (`letters`, `intervals`,
`text`), each behind the `data.tasks.Task` interface.
"""
