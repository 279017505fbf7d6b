"""Front ends on a composed model: commands and evaluation clients that the core never imports.

`combine` (check, compose and evaluate exports of separate runs), `generate` (stream a composed export to the
terminal), `serve` (an OpenAI-compatible HTTP server), `lm_eval` (the lm-eval model ``composed``),
`code_generation` (HumanEval samples), `code_eval` and `sandbox` (the sandboxed executor) and `model_folders`
(compose plain Hugging Face model folders). Each command keeps its documented form, ``python -m compose.<name>``,
through a thin module of that name in ``compose/``.
"""
