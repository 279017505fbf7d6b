"""compose.code_generation: greedy HumanEval samples from a ComposedLM, its background or one expert alone.

Built offline: a byte-level BPE, a tiny Llama background with two random LoRA experts exported twice (with
the experts, and the background alone) and three HumanEval-style problems of different prompt lengths.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from compose import ComposedLM, code_eval, export_composition
from compose.frontends.code_generation import (
    CHAT_STOP,
    CODEX_STOP_STRINGS,
    CodeGenSettings,
    build_prompt,
    cut_at_stop,
    encode_prompt,
    eos_token_ids,
    generate_completions,
    generate_samples,
    main,
    select_components,
)
from tests.tiny_code_models import BOS, PAD, PROBLEMS, code_tokenizer, tiny_lora, write_problems
from tests.tiny_models import needs_cpp_compiler

SPECS = {"a": {"interval": {"start": "(", "end": ")"}}}
NO_STOP = CodeGenSettings(max_new_tokens=20, batch_size=3, stop_strings=())


@dataclass
class World:
    tok: object
    experts: Path  # export: background + LoRA experts a (weight 0.5, an interval spec) and b
    background: Path  # export: the same background, no experts
    problems_file: Path
    problems: dict


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    root = tmp_path_factory.mktemp("codegen")
    tok = code_tokenizer()
    peft_model = tiny_lora(len(tok))
    export_composition(root / "experts", tokenizer=tok, peft_model=peft_model, weights={"a": 0.5}, specs=SPECS)
    export_composition(root / "background", tokenizer=tok, background=copy.deepcopy(peft_model).unload())
    path = write_problems(root / "problems.jsonl")
    return World(tok, root / "experts", root / "background", path, code_eval.load_problems(path))


def one_by_one(composed: ComposedLM, prompt: str, settings: CodeGenSettings) -> str:
    """What ComposedLM.generate gives for one unpadded prompt, decoded and cut as a completion."""
    tok = composed.tokenizer
    ids = encode_prompt(prompt, tok)
    eos = eos_token_ids(composed)
    out = composed.generate(torch.tensor([ids]), max_new_tokens=settings.max_new_tokens, eos_token_id=eos,
                            pad_token_id=tok.pad_token_id, stop_strings=list(settings.all_stop_strings) or None)
    new = out[0, len(ids):].tolist()
    new = new[: next((j for j, t in enumerate(new) if t in eos), len(new))]
    full = tok.decode(ids + new, skip_special_tokens=True)
    head = tok.decode(ids, skip_special_tokens=True)
    assert full.startswith(head)
    return cut_at_stop(full[len(head):], settings.all_stop_strings)


# ---------------------------------------------------------------------------------------------- generation


@pytest.mark.parametrize("backend", ["adapters", "separate"])
def test_batched_samples_equal_composed_generate_row_by_row(world, backend):
    composed = ComposedLM.from_manifest(world.experts, backend=backend)
    lengths = {len(encode_prompt(p["prompt"], world.tok)) for p in PROBLEMS}
    assert len(lengths) == len(PROBLEMS)  # one left-padded batch of three different prompt lengths
    for settings in (NO_STOP, CodeGenSettings(max_new_tokens=20, batch_size=3)):
        samples = generate_samples(composed, world.problems, settings=settings)
        assert [s["task_id"] for s in samples] == list(world.problems)
        for s in samples:
            assert s["completion"] == one_by_one(composed, world.problems[s["task_id"]]["prompt"], settings)
    # batch size 1 (no padding) and 2 (a partial last batch) give the same samples
    for batch_size in (1, 2):
        other = CodeGenSettings(max_new_tokens=20, batch_size=batch_size, stop_strings=())
        assert generate_samples(composed, world.problems, settings=other) == generate_samples(
            composed, world.problems, settings=NO_STOP)


def test_stop_strings_cut_completions(world):
    assert cut_at_stop("    return a\n\ndef g():\n    pass\n", CODEX_STOP_STRINGS) == "    return a\n"
    assert cut_at_stop("    if x:\n        print(1)\n#c", CODEX_STOP_STRINGS) == "    if x:\n        print(1)"
    assert cut_at_stop("abc", ()) == "abc"
    composed = ComposedLM.from_manifest(world.experts)
    prompts = [p["prompt"] for p in PROBLEMS]
    free = generate_completions(composed, prompts, NO_STOP)
    cut = 0
    for prompt, text in zip(prompts, free, strict=True):
        # a two-character stop string the free completion contains after its third character
        k = next(k for k in range(3, len(text) - 1) if text[k:k + 2].isprintable() and text[k:k + 2].strip())
        stop = text[k:k + 2]
        settings = CodeGenSettings(max_new_tokens=20, batch_size=3, stop_strings=(stop,))
        (stopped,) = generate_completions(composed, [prompt], settings)
        assert stopped == text[: text.find(stop)]
        assert stopped == one_by_one(composed, prompt, settings)
        cut += len(stopped) < len(text)
    assert cut == len(prompts)


def test_eos_ids_and_bad_settings(world):
    composed = ComposedLM.from_manifest(world.experts)
    assert eos_token_ids(composed) == [world.tok.eos_token_id]
    with pytest.raises(ValueError, match="batch_size"):
        CodeGenSettings(batch_size=0)
    with pytest.raises(ValueError, match=r"unknown task id\(s\) Nope/1"):
        generate_samples(composed, world.problems, ["Tiny/0", "Nope/1"], NO_STOP)


def test_chat_template_wraps_the_prompt_evalplus_style(world):
    settings = CodeGenSettings(chat_template=True)
    prompt = PROBLEMS[0]["prompt"]
    text = build_prompt(prompt, world.tok, settings)
    assert text.startswith("<bos><user>Please provide a self-contained Python script")
    assert text.endswith("passes corresponding tests:\n```python\n" + prompt)
    ids = encode_prompt(text, world.tok)
    assert ids.count(BOS) == 1 and ids[0] == BOS  # the template's BOS, not a second one
    assert encode_prompt(prompt, world.tok)[0] == BOS  # a raw prompt gets the tokenizer's BOS
    assert settings.all_stop_strings == CODEX_STOP_STRINGS + (CHAT_STOP,)
    assert build_prompt(prompt, world.tok) == prompt
    plain = copy.deepcopy(world.tok)
    plain.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        build_prompt(prompt, plain, settings)
    composed = ComposedLM.from_manifest(world.background)
    samples = generate_samples(composed, world.problems, settings=CodeGenSettings(max_new_tokens=8, chat_template=True))
    assert len(samples) == len(PROBLEMS)


# ---------------------------------------------------------------------------------------------- which model


@pytest.mark.parametrize("backend", ["adapters", "separate"])
def test_only_background_equals_composition_without_experts(world, backend):
    composed = ComposedLM.from_manifest(world.experts, backend=backend)
    background = select_components(composed, "background")
    assert background.num_experts == 0 and background.backend == backend
    reference = ComposedLM.from_manifest(world.background)
    ours = generate_samples(background, world.problems, settings=NO_STOP)
    assert ours == generate_samples(reference, world.problems, settings=NO_STOP)
    assert ours != generate_samples(composed, world.problems, settings=NO_STOP)  # the experts do change things
    assert select_components(composed, None) is composed


def test_only_expert_is_that_expert_itself(world):
    """The background and one expert at weight 1 under the rule is the expert's own distribution, whatever
    the expert's weight in the manifest (0.5 here)."""
    separate = ComposedLM.from_manifest(world.experts, backend="separate")
    adapters = ComposedLM.from_manifest(world.experts, backend="adapters")
    expert = separate.experts[separate.names.index("a")]  # the LoRA merged into a full copy
    alone = select_components(separate, "a")
    assert alone.names == ["a"] and alone.weights == [1.0] and alone.specs == [SPECS["a"]]
    ids = torch.tensor([encode_prompt(p["prompt"], world.tok)[:20] for p in PROBLEMS])
    with torch.no_grad():
        own = expert(ids).logits.float().log_softmax(-1)
    assert torch.allclose(alone.score(ids), own, atol=1e-5)
    assert torch.allclose(select_components(adapters, "a").score(ids), own, atol=1e-5)
    # greedy samples: the expert alone as a background with no experts, and HF's own generate
    itself = generate_samples(ComposedLM(expert, tokenizer=world.tok), world.problems, settings=NO_STOP)
    assert generate_samples(alone, world.problems, settings=NO_STOP) == itself
    assert generate_samples(select_components(adapters, "a"), world.problems, settings=NO_STOP) == itself
    prompt = torch.tensor([encode_prompt(PROBLEMS[0]["prompt"], world.tok)])
    hf = expert.generate(prompt, max_new_tokens=20, do_sample=False, eos_token_id=2, pad_token_id=PAD)
    assert world.tok.decode(hf[0, prompt.shape[1]:], skip_special_tokens=True).startswith(
        itself[0]["completion"])
    assert itself != generate_samples(select_components(separate, "b"), world.problems, settings=NO_STOP)


def test_only_unknown_expert_is_one_line(world):
    composed = ComposedLM.from_manifest(world.experts)
    with pytest.raises(ValueError) as err:
        select_components(composed, "zzz")
    assert "\n" not in str(err.value) and "'zzz'" in str(err.value) and "experts: a, b" in str(err.value)
    gated = ComposedLM.from_manifest(world.experts, composition="gated")
    alone = select_components(gated, "a")
    assert alone.composition == "gated" and alone.specs == [SPECS["a"]]


# ---------------------------------------------------------------------------------------------- command line


def test_cli_writes_samples_that_code_eval_reads(world, tmp_path, capsys):
    def argv(out: Path, *extra: str) -> list[str]:
        return ["--manifest", str(world.experts), "--problems", str(world.problems_file), "--out", str(out),
                "--limit", "2", "--max_new_tokens", "20", "--batch_size", "2", "--device", "cpu", "--stop", "none",
                *extra]

    out = tmp_path / "out" / "samples.jsonl"
    assert main(argv(out, "--evaluate", "--workers", "1")) == 0
    summary = json.loads(capsys.readouterr().out)
    samples = code_eval.read_samples(out)
    assert [s["task_id"] for s in samples] == ["Tiny/0", "Tiny/1"]
    first_two = ["Tiny/0", "Tiny/1"]
    assert samples == generate_samples(ComposedLM.from_manifest(world.experts), world.problems, first_two, NO_STOP)
    packed_out = tmp_path / "packed.jsonl"  # on oneDNN-packed weights: the same greedy samples
    assert main(argv(packed_out, "--packed_weights")) == 0
    capsys.readouterr()
    assert code_eval.read_samples(packed_out) == samples
    assert summary["n_samples"] == 2 and 0.0 <= summary["pass@1"] <= 1.0
    assert Path(summary["results"]).is_file()
    assert code_eval.main([str(out), "--problems", str(world.problems_file), "--workers", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["pass@1"] == summary["pass@1"]
    # the background alone, by name
    bg_out = tmp_path / "bg.jsonl"
    assert main(argv(bg_out, "--only", "background")) == 0
    reference = generate_samples(ComposedLM.from_manifest(world.background), world.problems, first_two, NO_STOP)
    assert code_eval.read_samples(bg_out) == reference


@needs_cpp_compiler
def test_cli_compile_writes_the_same_samples(world, tmp_path, capsys):
    argv = ["--manifest", str(world.experts), "--problems", str(world.problems_file), "--limit", "2",
            "--max_new_tokens", "20", "--batch_size", "2", "--device", "cpu", "--stop", "none"]
    eager, compiled = tmp_path / "eager.jsonl", tmp_path / "compiled.jsonl"
    assert main([*argv, "--out", str(eager)]) == 0
    assert main([*argv, "--out", str(compiled), "--compile"]) == 0
    capsys.readouterr()
    assert code_eval.read_samples(compiled) == code_eval.read_samples(eager)


@pytest.mark.parametrize("bad, needle", [
    (["--manifest", "{tmp}/missing"], "missing: no such export folder"),
    (["--only", "zzz"], "'zzz': no such expert"),
    (["--task_ids", "Tiny/0,Nope/7"], "Nope/7"),
    (["--compile", "fast"], "compile='fast' is not a torch.compile mode"),
    (["--compile", "--packed_weights"], "compile and packed_weights do not combine"),
])
def test_cli_bad_input_is_one_line_exit_2(world, tmp_path, capsys, bad, needle):
    argv = ["--manifest", str(world.experts), "--problems", str(world.problems_file), "--out",
            str(tmp_path / "s.jsonl"), "--device", "cpu", "--max_new_tokens", "2"]
    bad = [a.format(tmp=tmp_path) for a in bad]
    assert main(argv + bad) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err
    assert not (tmp_path / "s.jsonl").exists()


def test_chat_completion_that_closes_the_fence_at_once_stops_there():
    """The chat prompt ends inside an opened ```python fence, after a newline: a fence right at the start of the
    completion ends the code (measured on SmolLM2-135M-Instruct: it closes the fence at once, then writes prose)."""
    stops = CodeGenSettings(chat_template=True).all_stop_strings
    assert cut_at_stop("```\n\nThis script uses a list comprehension.", stops) == ""
    assert cut_at_stop("    return x\n```\nprose", stops) == "    return x\n"
