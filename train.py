"""Train composable experts: `python train.py [FILE.yaml ...] [dotted.key=value ...]`.

YAML files merge in order over `configs/default.yaml` (the embedded default: the toy letter-replacement
experiment), then the overrides. Examples:

    python train.py                                           # background + experts A→B, C→D + composition
    python train.py configs/experiment/letters_k4.yaml seed=1
    python train.py configs/debug/fast.yaml expert.reg_weight=0
    python train.py --print-config configs/experiment/letters_k8.yaml
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

DEFAULT = Path(__file__).resolve().parent / "configs" / "default.yaml"


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    print_only = "--print-config" in argv
    args = [a for a in argv if a != "--print-config"]
    files = [a for a in args if "=" not in a]
    overrides = [a for a in args if "=" in a]

    from omegaconf import OmegaConf

    from compose.distributed import is_leader
    from lightning_modules.pipeline.config import ConfigError, load_config

    if not is_leader():  # a rank > 0 that Lightning's DDP launcher started: rank 0 prints (and writes) for all
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (for the life of the process)
    if not print_only:
        from lightning_modules.pipeline.console import quiet

        quiet()  # no library noise on the console (lightning_modules/pipeline/console.py)
    try:
        cfg = load_config(files, overrides, base=DEFAULT)
        if print_only:
            print(OmegaConf.to_yaml(cfg))
            return 0
        from lightning_modules.pipeline.report import print_summary
        from lightning_modules.pipeline.stages import run

        summary = run(cfg, command=shlex.join(["python", "train.py", *argv]))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print_summary(summary)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main(sys.argv[1:]))
