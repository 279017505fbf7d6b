"""compose.generate: prompts, chat, weights, streaming and interval marks, on the tiny exports of ``test_lm_eval``."""

from __future__ import annotations

import io
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")

from compose import ComposedLM, export_composition  # noqa: E402
from compose.frontends.generate import IntervalMarker, TerminalStreamer, main  # noqa: E402
from compose.intervals import interval_char_spans  # noqa: E402
from tests.test_lm_eval import SPECS, bpe_tokenizer, tiny_peft  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MARK = re.compile(r"\[/?[ab]\]")


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("generate")
    tok = bpe_tokenizer()
    return export_composition(root / "experts", tokenizer=tok, peft_model=tiny_peft(len(tok)), specs=SPECS)


def run(argv: list[str], stdin: str = "") -> tuple[int, str]:
    out = io.StringIO()
    code = main(argv, stdin=io.StringIO(stdin), stdout=out)
    return code, out.getvalue()


def greedy(model: ComposedLM, text: str, n: int) -> str:
    ids = torch.tensor([model.tokenizer.encode(text)])
    row = model.generate(ids, max_new_tokens=n)[0, ids.shape[1]:].tolist()
    eos = model.tokenizer.eos_token_id
    return model.tokenizer.decode(row[: row.index(eos)] if eos in row else row, skip_special_tokens=True)


def test_prompt_through_the_chat_template_or_raw(export):
    model = ComposedLM.from_manifest(export)
    code, out = run([str(export), "--prompt", "is the cat on the mat?", "--max-new-tokens", "12"])
    assert code == 0
    assert out == greedy(model, "user: is the cat on the mat?\nassistant:", 12) + "\n"
    code, out = run([str(export), "--prompt", "Q: is the cat", "--raw", "--max-new-tokens", "12"])
    assert out == greedy(model, "Q: is the cat", 12) + "\n"
    code, piped = run([str(export), "--raw", "--max-new-tokens", "12"], stdin="Q: is the cat")
    assert piped == out


def test_weights_and_gated_composition(export):
    argv = [str(export), "--prompt", "[the] cat", "--raw", "--max-new-tokens", "12"]
    weighted = ComposedLM.from_manifest(export)
    weighted.weights = [0.0, 1.0]
    assert run([*argv, "--weight", "a=0"])[1] == greedy(weighted, "[the] cat", 12) + "\n"
    gated = ComposedLM.from_manifest(export, composition="gated")
    assert run([*argv, "--composition", "gated"])[1] == greedy(gated, "[the] cat", 12) + "\n"
    assert run([*argv, "--composition", "gated", "--lazy"])[1] == greedy(gated, "[the] cat", 12) + "\n"
    assert greedy(weighted, "[the] cat", 12) != greedy(gated, "[the] cat", 12)


def test_sampling_with_a_seed_reproduces(export):
    argv = [str(export), "--prompt", "the", "--raw", "--max-new-tokens", "16", "--temperature", "1.5"]
    first = run([*argv, "--seed", "3"])[1]
    assert run([*argv, "--seed", "3"])[1] == first
    assert len({run([*argv, "--seed", str(s)])[1] for s in range(4)}) > 1


def test_tokens_are_streamed_as_they_come(export):
    model = ComposedLM.from_manifest(export)
    writes: list[str] = []

    class Out(io.StringIO):
        def write(self, s: str) -> int:
            writes.append(s)
            return super().write(s)

    streamer = TerminalStreamer(model.tokenizer, Out(), eos_ids=[model.tokenizer.eos_token_id])
    ids = torch.tensor([model.tokenizer.encode("Q: is the cat")])
    out = model.generate(ids, max_new_tokens=10, eos_token_id=[], streamer=streamer)
    assert streamer.text == model.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert len([w for w in writes if w.strip()]) > 3  # one piece per token, not the text at the end


def test_show_intervals_marks_each_experts_spans(export):
    model = ComposedLM.from_manifest(export)
    code, out = run([str(export), "--prompt", "Q: is the cat", "--raw", "--max-new-tokens", "24",
                     "--show-intervals"])
    assert code == 0 and MARK.search(out)
    text = MARK.sub("", out).rstrip("\n")
    assert text == greedy(model, "Q: is the cat", 24)
    for name in ("a", "b"):  # the marks of one expert, read back, are its interval's spans
        spans, at, start = [], 0, None
        for piece in re.split(r"(\[/?[ab]\])", out.rstrip("\n")):
            if piece == f"[{name}]":
                start = at
            elif piece == f"[/{name}]":
                spans.append((start, at))
            elif not MARK.fullmatch(piece or "x"):
                at += len(piece)
        assert spans == interval_char_spans(text, SPECS[name]["interval"]), name
    coloured = IntervalMarker({n: s["interval"] for n, s in SPECS.items()}, colour=True)
    painted = coloured.feed(text) + coloured.close()
    assert "\x1b[32m" in painted and re.sub(r"\x1b\[[0-9;]*m", "", painted) == text


def test_chat_mode_keeps_the_conversation(export):
    model = ComposedLM.from_manifest(export)
    code, out = run([str(export), "--chat", "--max-new-tokens", "8"], stdin="is the cat on the mat?\ndid it?\n")
    first = greedy(model, "user: is the cat on the mat?\nassistant:", 8)
    second = greedy(model, f"user: is the cat on the mat?\nassistant: {first}\nuser: did it?\nassistant:", 8)
    assert code == 0 and out == f"{first}\n{second}\n"
    # /reset forgets the first turn
    code, out = run([str(export), "--chat", "--max-new-tokens", "8"], stdin="is the cat on the mat?\n/reset\ndid it?\n")
    assert out == f"{first}\n{greedy(model, 'user: did it?' + chr(10) + 'assistant:', 8)}\n"


def test_bad_input_is_one_line_and_exit_2(export, tmp_path, capsys):
    for argv, message in (
        ([str(export), "--prompt", "x", "--weight", "calc=1"], "no expert 'calc'"),
        ([str(export), "--prompt", "x", "--weight", "a"], "expected NAME=FLOAT"),
        ([str(export), "--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens"),
        ([str(tmp_path), "--prompt", "x"], "composition.yaml"),
        ([str(export), "--raw", "--prompt", "the cat " * 40], "the model holds 64"),
    ):
        assert run(argv)[0] == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("compose.generate: error:") and message in err[0], err


def test_module_command(export):
    proc = subprocess.run([sys.executable, "-m", "compose.generate", str(export), "--prompt", "the", "--raw",
                           "--max-new-tokens", "4"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == greedy(ComposedLM.from_manifest(export), "the", 4) + "\n"
