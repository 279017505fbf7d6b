"""The rows of the local letter tasks: `letters.jsonl` beside this file, as lm-eval's `custom_dataset`.

Each row is an input `x` over A–Z holding an A and a C, and its four rewrites: `x` copied (the background),
with A→B only, with C→D only, and with both (`composed`, what the default experiment's composition writes).
"""

from pathlib import Path

import datasets

ROWS = Path(__file__).with_name("letters.jsonl")


def load(**kwargs) -> dict[str, datasets.Dataset]:
    """`{"test": rows}` (lm-eval passes the task's metadata and dataset_kwargs; none are needed)."""
    return {"test": datasets.Dataset.from_json(str(ROWS))}
