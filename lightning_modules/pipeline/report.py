"""The run's human-readable report: a table in the terminal, and `report.md` with plots in the output folder.

`print_summary(summary)` prints the component table of a run's `summary.json`; `write_report(summary, out_dir)`
writes `out_dir/report.md` with every section the summary holds (components, composition details, parameter-merge
baselines, ablations, timing, how to reproduce) and embeds two plots: composed exact match against the number of
experts `k` per ablation variant, and the per-position divergence of each expert from the background with the
expert's mask outlined (the picture of "an expert acts only on its mask").

matplotlib is imported lazily inside the plotting functions (Agg backend), so importing this module stays light.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Sequence
from pathlib import Path

from compose.atomic import atomic_file, atomic_write_text

COMPONENT_COLUMNS: tuple[tuple[str, str], ...] = (
    ("exact_match", "exact match"),
    ("off_mask_kl", "off-mask KL"),
    ("on_mask_kl", "on-mask KL"),
    ("max_off_mask_log_ratio", "max off-mask log-ratio"),
    ("skill_accuracy", "skill accuracy"),
)
FAILURE_ORDER: tuple[str, ...] = ("correct", "rule_not_applied", "wrong_letter_elsewhere", "length_or_eos")
ACCURACY_PLOT = "accuracy_vs_k.png"
HEATMAP_PLOT = "divergence_heatmap.png"
LENGTH_PLOT = "accuracy_vs_length.png"
LM_EVAL_PLOT = "lm_eval_curves.png"
LM_EVAL_PREFIX = "val/lm_eval/"  # `val/lm_eval/<task>/<metric>/<model>` (`callbacks.DownstreamEvaluation`)
DIVERGENCE_MAP = "divergence_map.json"
_KNOWN_COMPOSITION_KEYS = {"exact_match", "k", "n_test", "nll", "projectivity_error", "failures", "overlap",
                           "notes", "gated", "features"}


# ----------------------------------------------------------------------------------------------- intervals


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a binomial fraction `successes / n` (z = 1.96: 95 %).

    Unlike the normal approximation p ± z·sqrt(p(1-p)/n) it stays inside [0, 1] and is not empty at p = 0 or 1:
    centre (p + z²/2n) / (1 + z²/n), half-width z·sqrt(p(1-p)/n + z²/4n²) / (1 + z²/n).

    Raises:
        ValueError: `n` < 1 or `successes` outside [0, n].
    """
    if n < 1 or not 0 <= successes <= n:
        raise ValueError(f"wilson_interval needs 0 <= successes <= n and n >= 1, got successes={successes}, n={n}")
    p, z2 = successes / n, z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    # at p = 0 (1) the lower (upper) end is exactly 0 (1); rounding would leave a few 1e-17 there
    return (0.0 if successes == 0 else max(0.0, centre - half)), (1.0 if successes == n else min(1.0, centre + half))


def fraction_count(entry: dict, key: str, rows: int | None = None) -> int | None:
    """How many trials the fraction `entry[key]` counts: `entry["<key>_n"]` when the summary records it, else for
    an exact match `rows` (the rows it was measured on, when the caller knows them) or the entry's `n_test`;
    None when the summary does not say."""
    count = entry.get(f"{key}_n")
    if count is None and key == "exact_match":
        count = rows if rows is not None else entry.get("n_test")
    return int(count) if isinstance(count, (int, float)) and not isinstance(count, bool) and count >= 1 else None


def fraction_interval(value, n: int | None, z: float = 1.96) -> tuple[float, float] | None:
    """The Wilson interval of a fraction `value` measured on `n` trials (successes `round(value * n)`); None when
    `n` is unknown or `value` is not a fraction."""
    if n is None or isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        return None
    return wilson_interval(round(value * n), n, z)


def add_intervals(entry: dict, rows: int | None = None) -> dict:
    """`entry` with `<key>_ci95: [lo, hi]` added beside every fraction whose count it records (`fraction_count`;
    `rows`: the rows its exact match was measured on, when the entry does not say). Returns `entry`."""
    for key in [k for k in entry if not k.endswith(("_n", "_ci95"))]:
        ci = fraction_interval(entry[key], fraction_count(entry, key, rows))
        if ci is not None:
            entry[f"{key}_ci95"] = [round(ci[0], 6), round(ci[1], 6)]
    return entry


def with_intervals(summary: dict) -> dict:
    """A copy of `summary` with `<key>_ci95: [lo, hi]` beside every fraction whose count it records (see
    `fraction_count`): each component's and merge's exact match, the composition's failure types, the
    ablations' exact match, and any `<key>` that has a `<key>_n`."""
    out = copy.deepcopy(summary)
    composition = out.get("composition") or {}
    rows = composition.get("n_test")
    entries = [(out.get("background") or {}, None), *((e or {}, None) for e in (out.get("experts") or {}).values()),
               (composition, rows), (composition.get("gated") or {}, rows),
               *((b or {}, rows) for b in (out.get("baselines") or {}).values()),
               *((e or {}, None) for v in (out.get("ablations") or {}).values() for e in ((v or {}).get("k") or {}).values())]
    for entry, n in entries:
        add_intervals(entry, n)
    failures = composition.get("failures") or {}
    for key in list(failures):
        ci = fraction_interval(failures[key], rows)
        if ci is not None:
            failures[f"{key}_ci95"] = [round(ci[0], 6), round(ci[1], 6)]
    return out


# ----------------------------------------------------------------------------------------------- formatting


def _fmt(v, digits: int = 4) -> str:
    """Format one table cell: floats to `digits` decimals (scientific when that would print a nonzero as 0)."""
    if v is None:
        return "-"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            return str(v)
        if v != 0 and abs(v) < 0.5 * 10 ** (-digits):
            return f"{v:.2e}"
        return f"{v:.{digits}f}"
    return str(v)


def _rate(value, n: int | None, digits: int = 4) -> str:
    """A fraction's cell: the value, and its 95 % Wilson interval when `n` (its trials) is known."""
    ci = fraction_interval(value, n)
    return _fmt(value, digits) if ci is None else f"{_fmt(value, digits)} [{ci[0]:.{digits}f}, {ci[1]:.{digits}f}]"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """A markdown table as lines."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def _k_sorted(ks) -> list[str]:
    """k keys (strings in JSON) sorted numerically where possible."""
    def key(k):
        try:
            return (0, float(k), "")
        except (TypeError, ValueError):
            return (1, 0.0, str(k))
    return sorted((str(k) for k in ks), key=key)


def _failure_keys(*failure_dicts: dict) -> list[str]:
    """Failure types in the canonical order, then any others in first-seen order."""
    seen = [k for k in FAILURE_ORDER if any(k in d for d in failure_dicts)]
    for d in failure_dicts:
        seen += [k for k in d if k not in seen]
    return seen


def _component_rows(summary: dict) -> list[list[str]]:
    """Rows of the component table: background, each expert, the composition."""
    rows = []
    background = summary.get("background") or {}
    rows.append(["background", *_component_cells(background)])
    for name, e in (summary.get("experts") or {}).items():
        label = f"expert {name}"
        if e.get("trained_in") == "compose_with":
            label += " (earlier export)"
        rows.append([label, *_component_cells(e)])
    if "composition" in summary:
        c = summary["composition"]
        label = f"**composition (k={c.get('k', '?')}, n={c.get('n_test', '?')})**"
        rows.append([label, f"**{_rate(c.get('exact_match'), fraction_count(c, 'exact_match'))}**"]
                    + ["-"] * (len(COMPONENT_COLUMNS) - 1))
        if "gated" in c:  # experts gated by their intervals' stopping-time detectors (on the same test rows)
            gated = c["gated"]
            rows.append([f"composition, gated (k={c.get('k', '?')})",
                         _rate(gated.get("exact_match"), fraction_count(gated, "exact_match", c.get("n_test")))]
                        + ["-"] * (len(COMPONENT_COLUMNS) - 1))
    return rows


def _component_cells(entry: dict) -> list[str]:
    """One component's cells of `COMPONENT_COLUMNS`, fractions with their 95 % interval where the count is known."""
    return [_rate(entry.get(k), fraction_count(entry, k)) for k, _ in COMPONENT_COLUMNS]


def _component_header() -> list[str]:
    return ["component"] + [title for _, title in COMPONENT_COLUMNS]


def print_summary(summary: dict) -> None:
    """Print the run's component table (markdown-style) to the terminal, then where the report is.

    Args:
        summary: the run summary (as in `summary.json`); every section but `background` may be missing.
    """
    print()
    for line in _table(_component_header(), _component_rows(summary)):
        print(line)
    print()
    out = summary.get("output_dir")
    timing = summary.get("timing") or {}
    total = f"  ({_fmt(timing['total_s'], 1)} s)" if "total_s" in timing else ""
    if out:
        print(f"output: {out}{total}")
        print(f"report: {Path(out) / 'report.md'}")


# ----------------------------------------------------------------------------------------------- plots


def plot_accuracy_vs_k(summary: dict, path: str | Path) -> Path | None:
    """Plot composed exact match against the number of experts `k`, one line per ablation variant.

    Args:
        summary: the run summary; reads `summary["ablations"][variant]["k"][k]["exact_match"]`.
        path: the PNG file to write.

    Returns:
        The path written, or None when the summary holds no ablation results to plot.
    """
    series = []
    for variant, entry in (summary.get("ablations") or {}).items():
        per_k = (entry or {}).get("k") or {}
        pts = [(float(k), per_k[k]["exact_match"]) for k in _k_sorted(per_k)
               if isinstance(per_k[k], dict) and per_k[k].get("exact_match") is not None]
        if pts:
            series.append((variant, pts))
    if not series:
        return None

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    markers = "osD^vP*Xh<>"
    fig, ax = plt.subplots(figsize=(6.0, 4.0), layout="constrained")
    all_ks = sorted({k for _, pts in series for k, _ in pts})
    for i, (variant, pts) in enumerate(series):
        ks, accs = zip(*pts, strict=True)
        ax.plot(ks, accs, marker=markers[i % len(markers)], linewidth=1.8, markersize=7, label=variant)
    ax.set_xticks(all_ks, [f"{k:g}" for k in all_ks])
    ax.set_ylim(0.0, 1.02)
    ax.set_xlabel("number of composed experts k")
    ax.set_ylabel("composed exact match")
    ax.set_title(f"Composition accuracy vs k ({summary.get('experiment', 'run')})")
    ax.grid(True, alpha=0.3)
    ax.legend(title="variant", loc="best")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as tmp:  # a kill never leaves half a PNG
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)
    return path


def _length_series(length: dict) -> tuple[list[int], dict[str, list[float | None]]]:
    """The lengths of a `summary["length"]` block in order, and per model (background, each expert alone,
    composition) its exact match at each (None where it was not measured)."""
    lengths = sorted(int(k) for k in length)
    names = ["background"] + list(dict.fromkeys(n for k in length for n in (length[k].get("experts") or {})))
    names += ["composition"] if any("composition" in v for v in length.values()) else []

    def value(entry: dict, name: str) -> float | None:
        return entry.get(name) if name in ("background", "composition") else (entry.get("experts") or {}).get(name)

    return lengths, {name: [value(length[str(n)], name) for n in lengths] for name in names}


def plot_accuracy_vs_length(summary: dict, path: str | Path) -> Path | None:
    """Plot exact match against input length, one line per model (background, each expert alone, composition),
    the lengths seen in training shaded.

    Args:
        summary: the run summary; reads `summary["length"][L]` (`Task.evaluate_lengths`).
        path: the PNG file to write.

    Returns:
        The path written, or None when the summary holds no length sweep.
    """
    length = summary.get("length") or {}
    if not length:
        return None
    lengths, series = _length_series(length)

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.0, 4.2), layout="constrained")
    trained = [n for n in lengths if length[str(n)].get("trained_length")]
    if trained:
        ax.axvspan(min(trained) - 0.5, max(trained) + 0.5, color="0.9", label="training lengths")
    markers = "osD^vP*Xh<>"
    for i, (name, values) in enumerate(series.items()):
        pts = [(n, v) for n, v in zip(lengths, values, strict=True) if v is not None]
        if pts:
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, ys, marker=markers[i % len(markers)], markersize=4, linewidth=2.2 if name == "composition"
                    else 1.4, label=name if name in ("background", "composition") else f"expert {name} alone")
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("input length (letters)")
    ax.set_ylabel("exact match")
    ax.set_title(f"Accuracy vs length ({summary.get('experiment', 'run')})")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)
    return path


def _check_divergence_map(divergence_map: dict, max_experts: int, max_inputs: int):
    """Validate the map's shapes; return (experts, inputs, token labels per input, divergence, masks), truncated."""
    for key in ("experts", "inputs", "outputs", "divergence", "masks"):
        if key not in divergence_map:
            raise ValueError(f"divergence_map is missing the key {key!r}")
    experts, inputs, outputs = divergence_map["experts"], divergence_map["inputs"], divergence_map["outputs"]
    div, masks = divergence_map["divergence"], divergence_map["masks"]
    if len(outputs) != len(inputs):
        raise ValueError(f"divergence_map has {len(inputs)} inputs but {len(outputs)} outputs")
    for key, value in (("divergence", div), ("masks", masks)):
        if len(value) != len(experts):
            raise ValueError(f"divergence_map[{key!r}] has {len(value)} rows, expected one per expert ({len(experts)})")
        for e, per_input in enumerate(value):
            if len(per_input) != len(inputs):
                raise ValueError(f"divergence_map[{key!r}][{e}] has {len(per_input)} entries, "
                                 f"expected one per input ({len(inputs)})")
    labels = []
    for n, y in enumerate(outputs):
        # The target tokens as written by the run (any tokenizer); older maps: one character per position.
        tokens = list(divergence_map["tokens"][n]) if "tokens" in divergence_map else list(y)
        n_pos = len(div[0][n]) if experts else len(tokens) + 1
        if n_pos == len(tokens) + 1:
            tokens = tokens + ["eos"]
        elif n_pos != len(tokens):
            raise ValueError(f"divergence_map['divergence'][0][{n}] has {n_pos} positions, "
                             f"expected {len(tokens)} target tokens (+ 1 for eos)")
        for e in range(len(experts)):
            if len(div[e][n]) != n_pos or len(masks[e][n]) != n_pos:
                raise ValueError(f"divergence_map expert {experts[e]!r} input {n}: divergence has {len(div[e][n])} "
                                 f"and masks {len(masks[e][n])} positions, expected {n_pos}")
        labels.append(tokens)
    n_e, n_i = min(len(experts), max_experts), min(len(inputs), max_inputs)
    return (list(experts[:n_e]), list(inputs[:n_i]), labels[:n_i],
            [row[:n_i] for row in div[:n_e]], [row[:n_i] for row in masks[:n_e]])


def _runs(mask: Sequence) -> list[tuple[int, int]]:
    """Contiguous runs of truthy entries as (start, length)."""
    runs, start = [], None
    for i, m in enumerate(list(mask) + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i - start))
            start = None
    return runs


def plot_divergence_heatmap(divergence_map: dict, path: str | Path, max_experts: int = 8,
                            max_inputs: int = 4) -> Path | None:
    """Plot each expert's per-position divergence from the background, with the expert's mask outlined.

    A grid of panels, experts (rows) × inputs (columns); each panel is a one-row heatmap of
    `KL(p_b || p_i)` at every output position (log-scaled colour shared by all panels) with the output
    tokens as x tick labels, and a rectangle around each run of positions where the expert's mask is 1.
    A composable expert is dark outside its rectangles.

    Args:
        divergence_map: `{"experts", "inputs", "outputs", "divergence", "masks"}` as written to
            `divergence_map.json` (divergence and masks indexed `[expert][input][position]`).
        path: the PNG file to write.
        max_experts: at most this many experts (rows) are drawn.
        max_inputs: at most this many inputs (columns) are drawn.

    Returns:
        The path written, or None when the map holds no expert or no input.

    Raises:
        ValueError: when a key is missing or the per-position lists do not match the outputs' lengths.
    """
    if not divergence_map or not divergence_map.get("experts") or not divergence_map.get("inputs"):
        return None
    experts, inputs, labels, div, masks = _check_divergence_map(divergence_map, max_experts, max_inputs)

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    norm = _log_norm(div)
    n_e, n_i = len(experts), len(inputs)
    panel_w = max(2.6, 0.32 * max(len(t) for t in labels))
    fig, axes = plt.subplots(n_e, n_i, figsize=(panel_w * n_i + 1.6, 0.95 * n_e + 1.3), squeeze=False,
                             layout="constrained")
    image = None
    for e in range(n_e):
        for n in range(n_i):
            image = _heatmap_panel(axes[e][n], div[e][n], masks[e][n], labels[n], norm)
            if n == 0:
                axes[e][n].set_ylabel(str(experts[e]), rotation=0, ha="right", va="center", fontsize=9)
            if e == 0:
                x = str(inputs[n])
                axes[e][n].set_title(f"x = {x if len(x) <= 28 else x[:25] + '...'}", fontsize=8)
    cbar = fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.9, pad=0.01)
    cbar.set_label("KL(p_b || p_i)  (log scale)")
    fig.suptitle("Per-position divergence of each expert from the background (cyan boxes: the expert's mask)",
                 fontsize=10)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as tmp:  # a kill never leaves half a PNG
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)
    return path


def _log_norm(div: list):
    """A log colour scale over every finite divergence of `div` (`[expert][input][position]`), spanning at most
    six decades below the largest."""
    import numpy as np
    from matplotlib.colors import LogNorm

    values = np.array([v for row in div for per_input in row for v in per_input], dtype=float)
    finite = values[np.isfinite(values)]
    vmax = float(finite.max()) if finite.size else 1.0
    positive = finite[finite > 0]
    vmin = max(float(positive.min()) if positive.size else 1e-6, vmax * 1e-6, 1e-8)
    if vmax <= vmin:
        vmax = vmin * 10.0
    return LogNorm(vmin=vmin, vmax=vmax, clip=True)


def _heatmap_panel(ax, divergence: Sequence[float], mask: Sequence, labels: Sequence[str], norm):
    """One panel: the positions' divergences as a one-row heatmap, each run of the mask boxed; returns the image."""
    import numpy as np
    from matplotlib.patches import Rectangle

    row = np.nan_to_num(np.asarray(divergence, dtype=float), nan=norm.vmin, posinf=norm.vmax, neginf=norm.vmin)
    image = ax.imshow(np.clip(row, norm.vmin, norm.vmax)[None, :], aspect="auto", cmap="magma", norm=norm)
    for start, length in _runs(mask):
        ax.add_patch(Rectangle((start - 0.5, -0.5), length, 1.0, fill=False, edgecolor="#00e5ff", linewidth=2.2))
    ax.set_xticks(range(len(labels)), labels, fontsize=7)
    ax.set_xlim(-0.5, len(labels) - 0.5)
    ax.set_yticks([])
    return image


# ----------------------------------------------------------------------------------------------- report.md


def _margin_label(key: str) -> str:
    """`margin_on_mask_below_2` -> "target margin on the masks: fraction below 2 nats" (other keys unchanged)."""
    for region, where in (("on_mask", "on the masks"), ("off_mask", "off the masks")):
        prefix = f"margin_{region}_"
        if key.startswith(prefix):
            stat = key[len(prefix):]
            stat = "smallest (nats)" if stat == "min" else f"fraction below {stat.removeprefix('below_')} nats"
            return f"composed target margin {where}: {stat}"
    return key


def _composition_section(c: dict) -> list[str]:
    lines = ["## Composition", ""]
    n = c.get("n_test")
    match = _rate(c.get("exact_match"), fraction_count(c, "exact_match")) if "exact_match" in c else None
    facts = [("compositional test inputs (n_test)", c.get("n_test")), ("experts composed (k)", c.get("k")),
             ("exact match" + (" (95 % interval)" if n else ""), match), ("NLL per token", c.get("nll")),
             ("projectivity error", c.get("projectivity_error"))]
    facts += [(_margin_label(k), v) for k, v in c.items()
              if k not in _KNOWN_COMPOSITION_KEYS and isinstance(v, (int, float))]
    lines += [f"- {name}: {v if isinstance(v, str) else _fmt(v)}" for name, v in facts if v is not None]
    lines.append("")
    failures = c.get("failures") or {}
    if failures:
        lines += ["### Failure types (fraction of compositional test inputs, 95 % interval)", ""]
        lines += _table(["type", "fraction"], [[k, _rate(failures[k], n)] for k in _failure_keys(failures)])
        lines.append("")
    overlap = c.get("overlap") or {}
    if overlap:
        lines += ["### Pairwise active-set overlap (IoU of the positions where each expert is active, KL(p_b ‖ p_i) above the threshold)", ""]
        lines += _table(["pair", "IoU"], [[pair.replace("__", " × "), _fmt(v)] for pair, v in overlap.items()])
        lines.append("")
    notes = c.get("notes")
    if notes:
        lines += ["Notes from the task (e.g. experts whose masks can claim the same positions): "
                  + ", ".join(f"`{s}`" for s in notes), ""]
    return lines


def _features_section(features: dict, n: int | None = None) -> list[str]:
    """The feature-space table (`compose.features.feature_metrics` and the task's per-feature exact match on the
    `n` compositional test rows)."""
    names = [k.removesuffix("/projectivity_error") for k in features if k.endswith("/projectivity_error")]
    experts = list(dict.fromkeys(k.split("/")[0] for k in features
                                 if k.count("/") == 1 and k.endswith("_kl") and not k.startswith("factorization_gap")))
    lines = ["## Feature space", "",
             "Per feature of the task's token bijection D: V → " + " × ".join(names) + ": the composed model's "
             "decoded exact match on that feature alone, and teacher-forced on the compositional test rows the "
             "projectivity error of its marginal, KL(p_owner^j ‖ p̂^j) (the background's marginal where no expert "
             "owns the feature). Each expert's KL(p_b^j ‖ p_i^j) on a feature where it must match the background "
             "(a feature it does not own: everywhere; one it owns: off its mask), and how far each component's "
             "next-token distribution is from the product of its feature marginals, KL(p ‖ Π_j p^j) (0 for a "
             "factored head).", ""]
    lines += _table(["feature", "composed exact match on it", "projectivity error"],
                    [[f, _rate(features.get(f"{f}/exact_match"), n), _fmt(features.get(f"{f}/projectivity_error"))]
                     for f in names])
    lines.append("")
    components = [k.split("/", 1)[1] for k in features if k.startswith("factorization_gap/")]
    rows = [[c, _fmt(features.get(f"factorization_gap/{c}"))]
            + [_fmt(features.get(f"{c}/{n}_kl")) if c in experts else "-" for n in names] for c in components]
    lines += _table(["component", "KL(p ‖ Π_j p^j)"] + [f"{n} KL off its feature mask" for n in names], rows)
    return lines + [""]


def _baselines_section(summary: dict) -> list[str]:
    baselines = summary.get("baselines") or {}
    composition = summary.get("composition") or {}
    composed, n = composition.get("exact_match"), composition.get("n_test")
    lines = ["## Baselines: parameter-space merges", "",
             "Task arithmetic merges the experts into one set of weights (θ_b + Σ (θ_i − θ_b)); TIES and DARE do "
             "the same after trimming/sign-resolving or randomly dropping and rescaling the deltas. The composition "
             "instead keeps every model and combines their next-token distributions at each step, "
             "log_softmax(lp_b + Σ w_i (lp_i − lp_b)). A merge only matches the composition when the experts' "
             "effects add up linearly in weight space; \"Δ vs composition\" is the merge's exact match minus the "
             "composition's, and \"max log-prob gap\" the largest difference between the merged model's and the "
             "composed model's log-probabilities on the test outputs.", ""]
    rows = []
    if composed is not None:
        rows.append(["composition (ours)", _rate(composed, fraction_count(composition, "exact_match")), _fmt(0.0), "-"])
    for method, b in baselines.items():
        em = (b or {}).get("exact_match")
        delta = em - composed if em is not None and composed is not None else None
        rows.append([method.replace("_", " "), _rate(em, fraction_count(b or {}, "exact_match", n)), _fmt(delta),
                     _fmt((b or {}).get("max_logprob_gap_vs_composed"))])
    lines += _table(["method", "exact match (95 % interval)", "Δ vs composition", "max log-prob gap"], rows)
    return lines + [""]


def _ablations_section(ablations: dict) -> list[str]:
    ks = _k_sorted({k for v in ablations.values() for k in ((v or {}).get("k") or {})})
    lines = ["## Ablations", "", "### Composed exact match by number of experts k", ""]
    rows = []
    for variant, v in ablations.items():
        per_k = (v or {}).get("k") or {}
        desc = (v or {}).get("description") or ""
        overrides = " ".join(f"`{o}`" for o in (v or {}).get("overrides") or [])
        rows.append([f"**{variant}**", desc, overrides or "-"]
                    + [_rate((per_k.get(k) or {}).get("exact_match"), fraction_count(per_k.get(k) or {}, "exact_match"))
                       for k in ks])
    lines += _table(["variant", "description", "overrides"] + [f"k={k}" for k in ks], rows)
    lines += ["", "### Factorizability and failure types per variant and k", ""]
    all_failures = [(e or {}).get("failures") or {} for v in ablations.values()
                    for e in ((v or {}).get("k") or {}).values()]
    fkeys = _failure_keys(*all_failures)
    rows = []
    for variant, v in ablations.items():
        per_k = (v or {}).get("k") or {}
        for k in _k_sorted(per_k):
            r = per_k[k] or {}
            f = r.get("failures") or {}
            rows.append([variant, k, _fmt(r.get("off_mask_kl")), _fmt(r.get("max_off_mask_log_ratio")),
                         _fmt(r.get("experts_min_exact_match"))] + [_fmt(f.get(name)) for name in fkeys])
    lines += _table(["variant", "k", "off-mask KL", "max off-mask log-ratio", "min expert exact match"] + fkeys, rows)
    return lines + [""]


def _length_section(length: dict) -> list[str]:
    """The length sweep as a table: exact match per length of every model, and the composition against the
    minimum of the experts' accuracies at that length (what it inherits if each component keeps its behaviour)."""
    lengths, series = _length_series(length)
    n = next(iter(length.values())).get("n")
    widest = fraction_interval(0.5, n if isinstance(n, int) else None)
    spread = (f"; on {n} inputs a fraction's 95 % Wilson interval is at most ±{(widest[1] - widest[0]) / 2:.2f}"
              if widest else "")
    lines = ["## Length generalization", "",
             f"Exact match at each input length ({n} inputs per length and model, greedy decoding; * = a training "
             "length): the background on copying, each expert alone on its own rows, the composition on rows "
             "needing every expert. `min` is the lowest expert accuracy at that length, `product` their product; "
             f"`comp − min` is what the composition gains (+) or loses (−) against its weakest component{spread}.", ""]
    experts = [name for name in series if name not in ("background", "composition")]
    header = ["length", "background", *experts]
    if "composition" in series:
        header += ["composition", "min", "product", "comp − min"]
    rows = []
    for n_letters in lengths:
        e = length[str(n_letters)]
        row = [f"{n_letters}{'*' if e.get('trained_length') else ''}", _fmt(e.get("background"), 3)]
        row += [_fmt((e.get("experts") or {}).get(name), 3) for name in experts]
        if "composition" in series:
            c, low = e.get("composition"), e.get("components_min")
            row += [_fmt(c, 3), _fmt(low, 3), _fmt(e.get("components_product"), 3),
                    "-" if c is None or low is None else f"{c - low:+.3f}"]
        rows.append(row)
    return lines + _table(header, rows) + [""]


def lm_eval_curves(metrics_csv: str | Path) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """The lm-eval scores logged at each validation, from a stage's `metrics.csv`:
    `{"<task>/<metric>": {model: [(step, value), ...]}}` in step order (`{}` when the file or the columns are
    missing)."""
    import csv

    path = Path(metrics_csv)
    if not path.is_file():
        return {}
    curves: dict[str, dict[str, list[tuple[int, float]]]] = {}
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            for key, value in row.items():
                if not (key or "").startswith(LM_EVAL_PREFIX) or value in (None, "") or not row.get("step"):
                    continue
                name, model = key[len(LM_EVAL_PREFIX):].rsplit("/", 1)
                curves.setdefault(name, {}).setdefault(model, []).append((int(float(row["step"])), float(value)))
    def order(model: str) -> int:  # background, the experts, the composition
        return {"background": 0, "composed": 2}.get(model, 1)

    return {name: {model: sorted(per_model[model]) for model in sorted(per_model, key=order)}
            for name, per_model in curves.items()}


def plot_lm_eval_curves(curves: dict, path: str | Path) -> Path | None:
    """One panel per lm-eval task and metric, one line per model over the validation steps; None without data."""
    if not curves:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(curves), 1, figsize=(6.0, 2.6 * len(curves)), layout="constrained", squeeze=False)
    for ax, (name, per_model) in zip(axes[:, 0], curves.items(), strict=True):
        for model, points in per_model.items():
            steps, values = zip(*points, strict=True)
            ax.plot(steps, values, marker="o", markersize=3, linewidth=2.2 if model == "composed" else 1.4, label=model)
        values = [v for points in per_model.values() for _, v in points]
        if min(values) > 0 and max(values) > 100 * min(values):  # perplexities far apart
            ax.set_yscale("log")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("training step (experts)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    path = Path(path)
    with atomic_file(path) as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)
    return path


def _lm_eval_section(out_dir: Path) -> list[str]:
    """The lm-eval scores at each validation of the experts stage (`composition.lm_eval`), read from
    `logs/experts/metrics.csv`: a table per task and metric, and their plot."""
    curves = lm_eval_curves(out_dir / "logs" / "experts" / "metrics.csv")
    if not curves:
        return []
    lines = ["## Downstream tasks during training (lm-eval)", "",
             "The lm-eval tasks of `composition.lm_eval`, run at each validation of the experts stage on the "
             "background, each expert alone and the composition (`val/lm_eval/<task>/<metric>/<model>` in "
             "`logs/experts/metrics.csv`).", ""]
    for name, per_model in curves.items():
        models = list(per_model)
        steps = sorted({step for points in per_model.values() for step, _ in points})
        values = {model: dict(points) for model, points in per_model.items()}
        lines += [f"### {name}", ""]
        def cell(v: float | None) -> str:
            return f"{v:.4g}" if v is not None and abs(v) >= 1e5 else _fmt(v)

        lines += _table(["step", *models], [[str(step), *(cell(values[m].get(step)) for m in models)] for step in steps])
        lines.append("")
    if plot_lm_eval_curves(curves, out_dir / LM_EVAL_PLOT) is not None:
        lines += [f"![lm-eval scores over training]({LM_EVAL_PLOT})", ""]
    return lines


def _reproduce_section(summary: dict) -> list[str]:
    command = summary.get("command")
    out = summary.get("output_dir")
    lines = ["## Reproduce", ""]
    if command:
        lines += ["```bash", str(command), "```"]
    elif out:
        lines += ["Rerun with this run's resolved config (into a fresh output folder):", "",
                  "```bash", f"python train.py {Path(out) / 'config.yaml'} output_dir={out}-rerun", "```"]
    else:
        lines += ["```bash", f"python train.py seed={summary.get('seed', 0)}", "```"]
    return lines + [""]


def write_report(summary: dict, out_dir: str | Path, divergence_map: dict | None = None) -> Path:
    """Write `out_dir/report.md` (and its PNG plots) from a run summary.

    Every fraction whose count the summary records (see `fraction_count`) is shown with its 95 % Wilson interval.

    Args:
        summary: the run summary (as in `summary.json`); every section but `background` may be missing.
        out_dir: the run's output folder; the report and plots are written there.
        divergence_map: the per-position divergences to draw; when None, `out_dir/divergence_map.json` is
            loaded if it exists.

    Returns:
        The path of `report.md`.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if divergence_map is None and (out_dir / DIVERGENCE_MAP).is_file():
        divergence_map = json.loads((out_dir / DIVERGENCE_MAP).read_text())
    for stale in (ACCURACY_PLOT, HEATMAP_PLOT, LENGTH_PLOT, LM_EVAL_PLOT):
        (out_dir / stale).unlink(missing_ok=True)
    lines = _head_section(summary)
    if "composition" in summary:
        lines += _composition_section(summary["composition"])
        if summary["composition"].get("features"):
            lines += _features_section(summary["composition"]["features"], summary["composition"].get("n_test"))
    if summary.get("baselines"):
        lines += _baselines_section(summary)
    lines += _plotted_sections(summary, out_dir, divergence_map)
    lines += _lm_eval_section(out_dir)
    timing = summary.get("timing") or {}
    if timing:
        lines += ["## Timing", ""]
        lines += _table(["stage", "seconds"], [[k.removesuffix("_s"), _fmt(v, 1)] for k, v in timing.items()])
        lines.append("")
    lines += _reproduce_section(summary)
    path = out_dir / "report.md"
    atomic_write_text(path, "\n".join(lines))
    return path


def _head_section(summary: dict) -> list[str]:
    """The title, where the run and its export are, and the component table."""
    title = f"# Run report: {summary.get('experiment', 'run')}"
    if "seed" in summary:
        title += f" (seed {summary['seed']})"
    lines = [title, ""]
    if summary.get("output_dir"):
        lines.append(f"- output folder: `{summary['output_dir']}`")
    if summary.get("export"):
        lines.append(f"- export for composition: `{summary['export']}`")
    lines += ["", "## Components", "",
              "Exact match of each component on its own held-out test data (the background on copying, each expert "
              "alone on its rule, the composition on the compositional test set), with its 95 % Wilson interval "
              "[low, high] where the summary records how many rows it counts; divergences from the background "
              "measured on the compositional test set.", ""]
    return lines + _table(_component_header(), _component_rows(summary)) + [""]


def _plotted_sections(summary: dict, out_dir: Path, divergence_map: dict | None) -> list[str]:
    """The ablation and length sections with their plots, and the divergence heatmap (each when there is data)."""
    lines: list[str] = []
    if summary.get("ablations"):
        lines += _ablations_section(summary["ablations"])
        if plot_accuracy_vs_k(summary, out_dir / ACCURACY_PLOT) is not None:
            lines += [f"![composed exact match vs k]({ACCURACY_PLOT})", ""]
    if summary.get("length"):
        lines += _length_section(summary["length"])
        if plot_accuracy_vs_length(summary, out_dir / LENGTH_PLOT) is not None:
            lines += [f"![exact match vs input length]({LENGTH_PLOT})", ""]
    if divergence_map and plot_divergence_heatmap(divergence_map, out_dir / HEATMAP_PLOT) is not None:
        lines += ["## Where each expert acts", "",
                  "Divergence KL(p_b ‖ p_i) of each expert from the background at every output position of a few "
                  "compositional test inputs (log colour scale); boxes outline the expert's mask, where it may act. "
                  "A composable expert is dark outside its boxes.", "",
                  f"![per-position divergence]({HEATMAP_PLOT})", ""]
    return lines
