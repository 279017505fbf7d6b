"""The run's human-readable summary: a table in the terminal (and report.md, see issue 4)."""

from __future__ import annotations


def _fmt(v) -> str:
    return f"{v:.4f}" if isinstance(v, float) else ("-" if v is None else str(v))


def print_summary(summary: dict) -> None:
    print()
    print("| component | exact match | off-mask KL | max off-mask log-ratio |")
    print("|---|---|---|---|")
    print(f"| background (copy) | {_fmt(summary['background']['exact_match'])} | - | - |")
    for name, e in summary.get("experts", {}).items():
        print(f"| expert {name} | {_fmt(e.get('exact_match'))} | {_fmt(e.get('off_mask_kl'))} "
              f"| {_fmt(e.get('max_off_mask_log_ratio'))} |")
    if "composition" in summary:
        c = summary["composition"]
        print(f"| **composition (k={c['k']}, n={c['n_test']})** | **{_fmt(c['exact_match'])}** | - | - |")
    print()
    print(f"output: {summary['output_dir']}  ({summary['timing']['total_s']} s)")
