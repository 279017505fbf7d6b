"""Model cards: an export's ``README.md``, in the format the Hugging Face Hub reads (YAML front matter + Markdown).

:func:`write_model_card` describes a composition for whoever receives the folder: the background, each expert
(kind, weight, the interval or rules it owns), headline metrics, and how to load it (:meth:`ComposedLM.from_manifest`)
and serve it (``python -m compose.serve``). The card is not covered by the manifest's checksums, so writing it
never invalidates an export.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from compose.atomic import atomic_file
from compose.export import MANIFEST_NAME, load_manifest

CARD_NAME = "README.md"
TAGS = ("composable-experts", "product-of-experts", "text-generation")


def write_model_card(export_dir: str | os.PathLike, manifest: Mapping[str, Any] | None = None,
                     metrics: Mapping[str, Any] | None = None, *, base_model: str | None = None,
                     title: str | None = None) -> Path:
    """Write ``export_dir/README.md`` for the export there and return its path.

    Args:
        export_dir: an export folder (see :func:`compose.export.export_composition`).
        manifest: its manifest as :func:`compose.export.load_manifest` returns it (default: read from the folder).
        metrics: headline numbers, flat (``{"composition.exact_match": 0.99}``) or nested (a run's
            ``summary.json``); numbers are shown, anything else is left out.
        base_model: the Hub id of the background's pretrained model, for the front matter's ``base_model``
            (default: the manifest's ``extra.base_model``, else none).
        title: the card's heading (default: the folder's name).

    Raises:
        FileNotFoundError: ``export_dir`` has no ``composition.yaml``.
        ValueError: the manifest does not validate (naming the key).
    """
    root = Path(export_dir)
    if manifest is None:
        if not (root / MANIFEST_NAME).is_file():
            raise FileNotFoundError(f"{root}: no {MANIFEST_NAME} (not an export folder)")
        manifest = load_manifest(root)
    text = model_card(manifest, metrics, base_model=base_model, title=title or root.resolve().name,
                      export_dir=str(root))
    path = root / CARD_NAME
    with atomic_file(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return path


def model_card(manifest: Mapping[str, Any], metrics: Mapping[str, Any] | None = None, *,
               base_model: str | None = None, title: str = "composed model", export_dir: str = "EXPORT") -> str:
    """The card's text (see :func:`write_model_card`)."""
    experts = list(manifest.get("experts") or [])
    extra = manifest.get("extra") or {}
    base_model = base_model or extra.get("base_model")
    lora = any(e.get("kind") == "lora" for e in experts)
    front: dict[str, Any] = {}
    if base_model:
        front["base_model"] = str(base_model)
    front["library_name"] = "peft" if lora else "transformers"
    front["pipeline_tag"] = "text-generation"
    front["tags"] = [*TAGS, *(["lora"] if lora else [])]
    background = manifest["background"]
    where = f"`{background['path']}/` in this folder" if "path" in background else f"referenced: `{background['ref']}`"
    lines = [
        "---", yaml.safe_dump(front, sort_keys=False).rstrip(), "---", "",
        f"# {title}", "",
        f"A composition of {len(experts)} expert{'s' if len(experts) != 1 else ''} with one background model: at "
        "every token the composed distribution is `log_softmax(lp_background + Σ w_i (lp_i − lp_background))`. "
        "Under gated composition an expert acts only inside its interval (from the end of its start delimiter "
        "through its end delimiter, read from the generated text).", "",
        "## Composition", "",
        f"- background: {where}" + (f" (`{base_model}`)" if base_model else ""),
        f"- tokenizer: `{manifest.get('tokenizer', 'tokenizer')}/`", "",
    ]
    if experts:
        lines += ["| expert | kind | weight | owns |", "|---|---|---|---|"]
        lines += [f"| {e['name']} | {e.get('kind', '')} | {_number(e.get('weight', 1.0))} | {_owns(e.get('spec'))} |"
                  for e in experts]
        lines.append("")
    rows = _metric_rows(metrics or {})
    if rows:
        lines += ["## Metrics", "", "| metric | value |", "|---|---|"]
        lines += [f"| {name} | {_number(value)} |" for name, value in rows]
        lines.append("")
    names = [e["name"] for e in experts]
    weight_example = f"--weight {names[0]}=0.5 " if names else ""
    lines += [
        "## Use", "",
        "In Python (checksums are verified before any weight is read):", "",
        "```python",
        "from compose import ComposedLM",
        "",
        f'model = ComposedLM.from_manifest("{export_dir}", composition="soft")  # or "gated"',
        'ids = model.tokenizer("Q: ...", return_tensors="pt").input_ids',
        "print(model.tokenizer.decode(model.generate(ids, max_new_tokens=64)[0]))",
        "```", "",
        "From a shell, a conversation or an OpenAI-compatible server:", "",
        "```bash",
        f"python -m compose.generate {export_dir} --chat {weight_example}--show-intervals",
        f"python -m compose.serve {export_dir} --port 8000",
        "```", "",
        "The server answers `/v1/completions` and `/v1/chat/completions`; a request may change the composition "
        'with the extension field `"composition": {"mode": "gated", "weights": {...}}`.', "",
    ]
    return "\n".join(lines)


def _owns(spec: Any) -> str:
    """What an expert owns, for a table cell: its interval's delimiters or its rules."""
    if not isinstance(spec, Mapping) or not spec:
        return "everything (no interval)"
    parts = []
    interval = spec.get("interval")
    if isinstance(interval, Mapping):
        kind = "regex " if interval.get("regex") else ""
        parts.append(f"{kind}interval {_code(interval.get('start'))} … {_code(interval.get('end'))}")
    rules = spec.get("rules")
    if rules:
        shown = ", ".join(f"{k}→{v}" for k, v in rules.items()) if isinstance(rules, Mapping) else str(rules)
        parts.append(f"rules {_code(shown)}")
    return "; ".join(parts) or ", ".join(sorted(str(k) for k in spec))


def _code(value: Any) -> str:
    text = str(value).replace("|", "\\|").replace("\n", "\\n").replace("`", "ˋ")
    return f"`{text}`"


def _metric_rows(metrics: Mapping[str, Any], prefix: str = "") -> list[tuple[str, float]]:
    rows = []
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            rows += _metric_rows(value, f"{name}.")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            rows.append((name, value))
    return rows


def _number(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
