"""Train composable experts: `python train.py [FILE.yaml ...] [dotted.key=value ...]`.

YAML files merge in order over `configs/default.yaml` (the embedded default: the toy letter-replacement
experiment), then the overrides. Examples:

    python train.py                                           # background + experts A→B, C→D + composition
    python train.py configs/experiment/letters_k4.yaml seed=1
    python train.py configs/debug/fast.yaml expert.reg_weight=0
    python train.py --print-config configs/experiment/letters_k8.yaml

SIGTERM or SIGINT (Ctrl-C) stops a run where it can resume: one line gives the command that resumes it
(`... output_dir=<run> ckpt_path=last`), and the exit status is 128 + the signal's number (143, 130).
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
    from lightning_modules.pipeline.resume import Interrupted

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
    except Interrupted as stop:
        if is_leader():
            print(stopped_line(stop, args), file=sys.stderr, flush=True)
        return stop.code
    print_summary(summary)
    return 0


def stopped_line(stop, args: list[str]) -> str:
    """The one line said when a signal stopped the run: how to resume it, or that it wrote nothing yet."""
    if stop.output_dir is None:
        return f"stopped by {stop.signal_name} before the run wrote anything: nothing to resume"
    kept = [a for a in args if not a.startswith(("output_dir=", "ckpt_path="))]
    again = shlex.join(["python", "train.py", *kept, f"output_dir={stop.output_dir}", "ckpt_path=last"])
    return f"stopped by {stop.signal_name}; what it needs to resume is saved: {again}"


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main(sys.argv[1:]))
