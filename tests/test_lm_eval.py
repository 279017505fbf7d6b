"""compose.lm_eval: the lm-eval model ``composed`` and ``ComposedLM.generate(stop_strings=...)``.

Everything is built here, offline: a small BPE tokenizer (no pre-tokenizer, so merges cross word and
line boundaries, tokens hold spaces and newlines), a tiny Llama background with two LoRA experts, two
exports (with and without experts) and local lm-eval task YAMLs over JSONL files.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")

from lm_eval import simple_evaluate  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.api.registry import get_model  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402
from tokenizers import Tokenizer, decoders, models, processors, trainers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402

from compose import ComposedLM, export_composition  # noqa: E402
from compose.frontends.lm_eval import ComposedLMEval, main, resolve_tasks  # noqa: E402
from tests.tiny_models import needs_cpp_compiler  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PAD, BOS, EOS = 0, 1, 2
CORPUS = [
    "the cat sat on the mat.\nthe dog ran to the hat.\n\nQ: is the cat on the mat?\nA: yes\n",
    "Q: what is two and three?\nA: five.\n[the] cat [saw] a dog, no maybe.\n",
]
ALPHABET = sorted(set("".join(CORPUS)) | set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"))
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
# Regex intervals over frequent letters, so the random experts' gates open and close often.
SPECS = {
    "a": {"interval": {"start": "[a-h]", "end": "[i-p]", "regex": True}},
    "b": {"interval": {"start": "[q-v]", "end": r"[w-z]|\.", "regex": True}},
}
QUESTIONS = ["is the cat on the mat?", "did the dog run?", "what is two and three?", "is the hat red?"]
LONG_TEXT = " ".join(CORPUS) * 3  # > 128 tokens: several rolling windows, left truncation
TASKS = ["tiny_mc", "tiny_gen", "tiny_roll", "tiny_ll"]


def bpe_tokenizer() -> PreTrainedTokenizerFast:
    """A 110-token BPE (tokens like ``'?\\nA: '``, ``' the '``, ``'e.\\n'``) that adds BOS, like Llama's."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    trainer = trainers.BpeTrainer(vocab_size=110, special_tokens=["<pad>", "<bos>", "<eos>", "<unk>"],
                                  initial_alphabet=ALPHABET, show_progress=False)
    tok.train_from_iterator(CORPUS * 10, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", BOS)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                   unk_token="<unk>", clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_peft(vocab: int):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)
    model = get_peft_model(LlamaForCausalLM(config).eval(), lora, adapter_name="a")
    model.add_adapter("b", lora)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model.eval()


def write_tasks(folder: Path) -> None:
    """Local YAMLs: multiple choice, generate_until, loglikelihood_rolling, loglikelihood (trailing space)."""
    folder.mkdir()
    rows = [{"question": q, "choices": ["yes", "no", "five"], "answer": i % 3, "prompt": f"Q: {q}\nA:",
             "target": "yes"} for i, q in enumerate(QUESTIONS)]
    (folder / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    texts = [{"text": LONG_TEXT}, {"text": "the cat sat."}]
    (folder / "text.jsonl").write_text("".join(json.dumps(r) + "\n" for r in texts))

    def source(name: str) -> str:
        return f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {folder / name}\ntest_split: test\n"

    (folder / "mc.yaml").write_text(
        "task: tiny_mc\n" + source("qa.jsonl") + "output_type: multiple_choice\n"
        "doc_to_text: \"Q: {{question}}\\nA:\"\ndoc_to_choice: \"{{choices}}\"\ndoc_to_target: \"{{answer}}\"\n"
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n")
    (folder / "gen.yaml").write_text(
        "task: tiny_gen\n" + source("qa.jsonl") + "output_type: generate_until\n"
        "doc_to_text: \"{{prompt}}\"\ndoc_to_target: \"{{target}}\"\n"
        "generation_kwargs:\n  until: [\"\\n\", \".\"]\n  do_sample: false\n  max_gen_toks: 12\n"
        "metric_list:\n  - metric: exact_match\n")
    (folder / "roll.yaml").write_text(
        "task: tiny_roll\n" + source("text.jsonl") + "output_type: loglikelihood_rolling\n"
        "doc_to_text: \"\"\ndoc_to_target: \"{{text}}\"\ntarget_delimiter: \"\"\n"
        "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n")
    (folder / "ll.yaml").write_text(
        "task: tiny_ll\n" + source("qa.jsonl") + "output_type: loglikelihood\n"
        "doc_to_text: \"{{prompt}} \"\ndoc_to_target: \"{{target}}\"\ntarget_delimiter: \"\"\n"
        "metric_list:\n  - metric: perplexity\n  - metric: acc\n")


@dataclass
class World:
    tok: PreTrainedTokenizerFast
    experts: Path  # export: background + LoRA experts a, b (with interval specs)
    background: Path  # export: the same background, no experts
    tasks: Path

    def manager(self) -> TaskManager:
        return TaskManager(include_path=str(self.tasks), include_defaults=False)


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    root = tmp_path_factory.mktemp("lm_eval")
    tok = bpe_tokenizer()
    peft_model = tiny_peft(len(tok))
    export_composition(root / "experts", tokenizer=tok, peft_model=peft_model, specs=SPECS)
    export_composition(root / "background", tokenizer=tok, background=copy.deepcopy(peft_model).unload())
    write_tasks(root / "tasks")
    return World(tok, root / "experts", root / "background", root / "tasks")


def lm(world: World, export: str = "experts", **kw) -> ComposedLMEval:
    return ComposedLMEval(manifest=getattr(world, export), device="cpu", **kw)


def requests(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(kind, {}, a, i) for i, a in enumerate(args)]


# ---------------------------------------------------------------------------------------------- stop strings


def left_padded(tok, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    tok.padding_side = "left"
    enc = tok(prompts, padding=True, return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"]


def cut_at_stops(tok, free: torch.Tensor, width: int, stops: list[str]) -> tuple[torch.Tensor, list[int]]:
    """What stopping each row of a free run once its generated text holds a stop string (or EOS) gives."""
    gen = free[:, width:].tolist()

    def end(row: list[int]) -> int:
        for j in range(1, len(row) + 1):
            if row[j - 1] == EOS or any(s in tok.decode(row[:j], skip_special_tokens=False) for s in stops):
                return j
        return len(row)

    ends = [end(row) for row in gen]
    expected = free[:, : width + max(ends)].clone()
    for row, e in enumerate(ends):
        expected[row, width + e :] = PAD
    return expected, ends


def test_generate_stop_strings_stop_each_row_and_pad(world):
    model = ComposedLM.from_manifest(world.experts)
    ids, mask = left_padded(world.tok, ["Q: is the cat", "the dog", "A: five.\n[the]"])
    n, width = 16, ids.shape[1]
    kw = dict(max_new_tokens=n, eos_token_id=[], pad_token_id=PAD)
    free = model.generate(ids, mask, **kw)
    gen = free[0, width:].tolist()
    # A stop string across a token boundary of row 0, and a one-character one.
    stops = [world.tok.decode(gen[3:4])[-1] + world.tok.decode(gen[4:5])[0], "\n"]
    expected, ends = cut_at_stops(world.tok, free, width, stops)
    assert ends[0] <= 5 and len(set(ends)) > 1  # row 0 stops early, rows stop at different steps
    assert torch.equal(model.generate(ids, mask, stop_strings=stops, **kw), expected)
    # No (or only empty) stop strings: bit-for-bit the plain generate.
    for none in (None, [], [""]):
        assert torch.equal(model.generate(ids, mask, stop_strings=none, **kw), free)


@pytest.mark.parametrize("composition", ["soft", "gated"])
def test_generate_stop_strings_with_eos_and_gates(world, composition):
    model = ComposedLM.from_manifest(world.experts, composition=composition)
    ids, mask = left_padded(world.tok, ["Q: is the cat", "the dog", "[the] cat"])
    free = model.generate(ids, mask, max_new_tokens=12)
    expected, ends = cut_at_stops(world.tok, free, ids.shape[1], ["t", "\n"])
    assert min(ends) < 12
    assert torch.equal(model.generate(ids, mask, max_new_tokens=12, stop_strings=["t", "\n"]), expected)


def test_generate_stop_strings_need_a_tokenizer_and_a_pad(world):
    ids, mask = left_padded(world.tok, ["Q: is the cat", "the dog"])
    with_tok = ComposedLM.from_manifest(world.background)
    bare = ComposedLM(with_tok.background)
    with pytest.raises(ValueError, match="tokenizer"):
        bare.generate(ids, mask, max_new_tokens=4, stop_strings=["e"])
    ref = with_tok.generate(ids, mask, max_new_tokens=4, stop_strings=["e"])
    assert torch.equal(bare.generate(ids, mask, max_new_tokens=4, stop_strings=["e"], tokenizer=world.tok), ref)
    unpadded = copy.deepcopy(with_tok.background)
    unpadded.generation_config.pad_token_id = None
    with pytest.raises(ValueError, match="pad_token_id"):  # nothing to fill a stopped row with
        ComposedLM(unpadded).generate(ids, mask, max_new_tokens=4, stop_strings=["e"], tokenizer=world.tok,
                                      eos_token_id=[])


# ---------------------------------------------------------------------------------------------- loglikelihood


def reference_loglikelihood(model: ComposedLM, tok, context: str, continuation: str, max_length: int,
                            gated: bool = False) -> float:
    """Sum of ``model.score`` log-probs over the continuation tokens, encoded by lm-eval's causal rules."""
    if context == "":
        ctx, cont = [BOS], tok.encode(continuation, add_special_tokens=False)
    else:
        n = len(context) - len(context.rstrip())
        if n:
            context, continuation = context[:-n], context[-n:] + continuation
        ctx = tok.encode(context)
        cont = tok.encode(context + continuation)[len(ctx):]
    window = (ctx + cont)[-(max_length + 1):]
    ids = torch.tensor([window[:-1]])
    masks = model.interval_masks(ids, len(window) - len(cont)) if gated else None
    lp = model.score(ids, masks=masks)[0, -len(cont):]
    return float(lp.gather(-1, torch.tensor(cont)[:, None]).sum())


LL_ARGS = [
    ("Q: is the cat on the mat?\nA:", " yes"),
    ("Q: is the cat on the mat?\nA: ", "yes"),  # the trailing space moves to the continuation
    ("Q: is the", " cat on the mat"),  # merges across the boundary
    ("", "the cat sat."),  # empty context: BOS alone conditions
    ("the dog ran", "."),
    ("the dog ran", ","),  # same context, one-token continuations: one row for both
    (LONG_TEXT, " the cat"),  # longer than max_length: left-truncated
]


@pytest.mark.parametrize("composition", ["soft", "gated"])
def test_loglikelihood_equals_sums_of_score(world, composition):
    model = lm(world, batch_size=3, composition=composition)
    out = model.loglikelihood(requests("loglikelihood", LL_ARGS), disable_tqdm=True)
    ref = [reference_loglikelihood(model.composed, world.tok, c, x, model.max_length, composition == "gated")
           for c, x in LL_ARGS]
    diffs = [abs(o[0] - r) for o, r in zip(out, ref, strict=True)]
    assert max(diffs) < 1e-4, diffs
    # Batch size does not change a number; the experts and the gates do act.
    one = lm(world, batch_size=1, composition=composition).loglikelihood(requests("loglikelihood", LL_ARGS), True)
    assert max(abs(a[0] - b[0]) for a, b in zip(out, one, strict=True)) < 1e-4
    other = "soft" if composition == "gated" else "gated"
    assert ref != [reference_loglikelihood(model.composed, world.tok, c, x, model.max_length, other == "gated")
                   for c, x in LL_ARGS]


def test_is_greedy_and_rolling_windows(world):
    model = lm(world, batch_size=2)
    ids = torch.tensor([world.tok.encode("Q: is the cat")])
    greedy = model.composed.generate(ids, max_new_tokens=3, eos_token_id=[])[0, ids.shape[1]:].tolist()
    cont = world.tok.decode(greedy)
    [(_, is_greedy)] = model.loglikelihood(requests("loglikelihood", [("Q: is the cat", cont)]), True)
    assert is_greedy == (world.tok.encode("Q: is the cat" + cont)[ids.shape[1]:] == greedy)
    # Rolling: the whole string (BOS added by the tokenizer, as hf does) scored in windows of max_length.
    [rolled] = model.loglikelihood_rolling(requests("loglikelihood_rolling", [(LONG_TEXT,)]), True)
    tokens = world.tok.encode(LONG_TEXT)
    assert len(tokens) > 2 * model.max_length
    total, done = 0.0, 0
    while done < len(tokens):  # disjoint windows, each with the longest context that fits
        end = min(done + model.max_length, len(tokens))
        window = ([BOS] + tokens)[max(0, end - model.max_length): end + 1] if done else [BOS] + tokens[:end]
        lp = model.composed.score(torch.tensor([window[:-1]]))[0, -(end - done):]
        total += float(lp.gather(-1, torch.tensor(tokens[done:end])[:, None]).sum())
        done = end
    assert abs(rolled - total) < 1e-4


# ---------------------------------------------------------------------------------------------- generate_until


GEN_ARGS = [
    ("Q: is the cat on the mat?\nA:", {"until": ["\n", "."], "do_sample": False, "max_gen_toks": 12}),
    ("the dog", {"until": ["\n", "."], "do_sample": False, "max_gen_toks": 12}),
    ("Q: what is two", {"until": ["\n", "."], "do_sample": False, "max_gen_toks": 12}),
    ("the cat sat on", {"until": ["e"], "max_gen_toks": 8}),
    ("[the] cat", {"until": "t"}),  # a string, and the default max_gen_toks
]


@pytest.mark.parametrize("composition", ["soft", "gated"])
def test_generate_until_equals_composed_generate_with_stop_strings(world, composition):
    model = lm(world, batch_size=1, composition=composition, max_gen_toks=20)
    out = model.generate_until(requests("generate_until", GEN_ARGS), disable_tqdm=True)
    cut_somewhere = False
    for (context, kwargs), text in zip(GEN_ARGS, out, strict=True):
        until = [kwargs["until"]] if isinstance(kwargs["until"], str) else list(kwargs["until"])
        until.append("<eos>")
        ids = torch.tensor([world.tok.encode(context)])
        n = kwargs.get("max_gen_toks", 20)
        row = model.composed.generate(ids, max_new_tokens=n, stop_strings=until)[0, ids.shape[1]:]
        ref = world.tok.decode(row, skip_special_tokens=True)
        free = world.tok.decode(model.composed.generate(ids, max_new_tokens=n)[0, ids.shape[1]:],
                                skip_special_tokens=True)
        for s in until:
            ref = ref.split(s)[0]
        assert text == ref
        cut_somewhere |= len(ref) < len(free)
    assert cut_somewhere
    batched = lm(world, batch_size=3, composition=composition, max_gen_toks=20)
    assert batched.generate_until(requests("generate_until", GEN_ARGS), disable_tqdm=True) == out


# ---------------------------------------------------------------------------------------------- against hf


def evaluate(world: World, model: str, model_args: str, tasks=TASKS, **kw) -> dict:
    return simple_evaluate(model=model, model_args=model_args, tasks=list(tasks), task_manager=world.manager(),
                           device="cpu", batch_size=3, log_samples=True, bootstrap_iters=0, **kw)


def assert_same_results(ours: dict, theirs: dict, tasks) -> float:
    """Same metrics and per-sample responses; returns the largest log-likelihood difference."""
    worst = 0.0
    for task in tasks:
        a, b = ours["results"][task], theirs["results"][task]
        assert a.keys() == b.keys()
        for key in a:
            if isinstance(a[key], float):
                assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (task, key)
            else:
                assert a[key] == b[key], (task, key)
        for sa, sb in zip(ours["samples"][task], theirs["samples"][task], strict=True):
            assert sa["doc_id"] == sb["doc_id"] and sa["arguments"] == sb["arguments"]
            for ra, rb in zip(sa["resps"], sb["resps"], strict=True):
                if isinstance(ra[0], str):
                    assert ra == rb
                else:
                    ra, rb = ra[0] if isinstance(ra[0], tuple) else ra, rb[0] if isinstance(rb[0], tuple) else rb
                    worst = max(worst, abs(float(ra[0]) - float(rb[0])))
                    assert ra[1:] == rb[1:]
    assert worst < 1e-4
    return worst


def hf_args(world: World) -> str:
    return f"pretrained={world.background / 'background'},tokenizer={world.background / 'tokenizer'}"


def test_no_experts_equals_hf(world):
    ours = evaluate(world, "composed", f"manifest={world.background}")
    theirs = evaluate(world, "hf", hf_args(world))
    assert_same_results(ours, theirs, TASKS)
    assert ours["results"]["tiny_roll"]["word_perplexity,none"] > 1
    with_experts = evaluate(world, "composed", f"manifest={world.experts}", tasks=["tiny_ll"])
    assert with_experts["results"]["tiny_ll"]["perplexity,none"] != ours["results"]["tiny_ll"]["perplexity,none"]


def test_chat_template_equals_hf(world):
    ours = evaluate(world, "composed", f"manifest={world.background}", tasks=["tiny_mc", "tiny_gen"],
                    apply_chat_template=True)
    theirs = evaluate(world, "hf", hf_args(world), tasks=["tiny_mc", "tiny_gen"], apply_chat_template=True)
    assert_same_results(ours, theirs, ["tiny_mc", "tiny_gen"])
    assert ours["samples"]["tiny_gen"][0]["arguments"][0][0].startswith("user: Q:")
    model = lm(world, "background")
    assert model.chat_template(True) == CHAT_TEMPLATE
    assert model.apply_chat_template([{"role": "user", "content": "hi"}]) == "user: hi\nassistant:"


def test_registered_with_lm_eval_models_and_model_args(world):
    assert get_model("composed") is ComposedLMEval
    assert get_model("hf").__name__ == "HFLM"  # lm-eval's own names still resolve
    model = ComposedLMEval.create_from_arg_string(f"manifest={world.experts},composition=gated,backend=separate,"
                                                  "max_length=32", {"batch_size": 2, "device": "cpu"})
    assert (model.batch_size, model.max_length, model.composed.backend) == (2, 32, "separate")
    assert model.composed.composition == "gated" and model.get_model_info()["experts"] == ["a", "b"]


def test_bad_model_args_and_tokenizer_mismatch(world, tmp_path):
    with pytest.raises(ValueError, match=r"unknown model_args \['pretrained'\]"):
        ComposedLMEval(manifest=world.experts, pretrained="x")
    with pytest.raises(ValueError, match="batch_size"):
        ComposedLMEval(manifest=world.experts, batch_size="auto")
    with pytest.raises(ValueError, match="manifest"):
        ComposedLMEval()
    # A background folder that carries its own, different tokenizer.
    bg = tmp_path / "bg"
    ComposedLM.from_manifest(world.background).background.save_pretrained(bg)
    other = bpe_tokenizer()
    other.add_tokens(["zzz"])
    other.save_pretrained(bg)
    export_composition(tmp_path / "export", tokenizer=world.tok, background_ref=str(bg))
    with pytest.raises(ValueError) as err:
        ComposedLMEval(manifest=tmp_path / "export")
    message = str(err.value)
    assert "\n" not in message and str(bg) in message and str(tmp_path / "export") in message
    world.tok.save_pretrained(bg)  # the same tokenizer beside the background is fine
    export_composition(tmp_path / "export2", tokenizer=world.tok, background_ref=str(bg))
    assert ComposedLMEval(manifest=tmp_path / "export2", device="cpu").composed.num_experts == 0


def test_packed_weights_give_the_same_answers_and_are_released(world):
    from torch import nn

    plain = lm(world, batch_size=2)
    packed = lm(world, batch_size=2, packed_weights="True")  # as lm-eval's model_args string gives it
    assert packed.packed_weights and not plain.packed_weights
    seen = []
    score = packed.composed.score

    def spy(*args, **kwargs):  # were the linear layers packed while scoring?
        seen.append(any("forward" in vars(m) for m in packed.composed.modules() if type(m) is nn.Linear))
        return score(*args, **kwargs)

    packed.composed.score = spy
    out = packed.loglikelihood(requests("loglikelihood", LL_ARGS), disable_tqdm=True)
    ref = plain.loglikelihood(requests("loglikelihood", LL_ARGS), disable_tqdm=True)
    assert seen and all(seen) == torch.backends.mkldnn.is_available()
    assert max(abs(a[0] - b[0]) for a, b in zip(out, ref, strict=True)) < 1e-4
    gen = requests("generate_until", GEN_ARGS[:3])
    assert packed.generate_until(gen, disable_tqdm=True) == plain.generate_until(gen, disable_tqdm=True)
    assert not any("forward" in vars(m) for m in packed.composed.modules() if type(m) is nn.Linear)
    with pytest.raises(ValueError, match="packed_weights must be true or false, got 'maybe'"):
        lm(world, packed_weights="maybe")


@needs_cpp_compiler
def test_compile_model_arg_decodes_compiled_with_the_same_generations(world):
    gen = requests("generate_until", GEN_ARGS[:3])
    plain = lm(world, batch_size=2)
    compiled = lm(world, batch_size=2, compile="True")  # as lm-eval's model_args string gives it
    assert compiled.compile is True and compiled.get_model_info()["compile"] is True and plain.compile is False
    seen = []
    generate = compiled.composed.generate

    def spy(*args, **kwargs):
        seen.append(kwargs["compile"])
        return generate(*args, **kwargs)

    compiled.composed.generate = spy
    assert compiled.generate_until(gen, disable_tqdm=True) == plain.generate_until(gen, disable_tqdm=True)
    assert seen == [True, True]  # two batches, each decoded compiled


def test_bad_compile_model_arg_is_one_line(world, capsys):
    with pytest.raises(ValueError, match="composed: compile='fast' is not a torch.compile mode"):
        lm(world, compile="fast")
    with pytest.raises(ValueError, match="compile and packed_weights do not combine"):
        lm(world, compile="reduce-overhead", packed_weights=True)
    argv = ["--manifest", str(world.experts), "--tasks", "tiny_gen", "--include_path", str(world.tasks),
            "--no_default_tasks", "--device", "cpu", "--compile", "fast"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "compile='fast'" in err[0]


# ---------------------------------------------------------------------------------------------- command line


def test_cli_runs_end_to_end_and_writes_results(world, tmp_path, capsys):
    out = tmp_path / "results" / "r.json"
    argv = ["--manifest", str(world.experts), "--tasks", "tiny_mc,tiny_gen", "--include_path", str(world.tasks),
            "--limit", "2", "--batch_size", "2", "--composition", "gated", "--device", "cpu", "--output", str(out)]
    assert main(argv) == 0
    results = json.loads(out.read_text())
    assert set(results["results"]) == {"tiny_mc", "tiny_gen"}
    assert results["config"]["model"] == "composed" and results["config"]["model_args"]["composition"] == "gated"
    assert "tiny_mc" in capsys.readouterr().out
    names, _ = resolve_tasks(["tiny_*"], str(world.tasks))
    assert names == sorted(TASKS)


def test_cli_unknown_task_exits_2_with_one_line(world):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    proc = subprocess.run(
        [sys.executable, "-m", "compose.lm_eval", "--manifest", str(world.experts), "--tasks", "tiny_mc,no_such_task",
         "--include_path", str(world.tasks), "--no_default_tasks"],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "no_such_task" in lines[0] and "tiny_mc" not in lines[0], proc.stderr
    assert proc.stdout == ""
