"""Talk to a composed export: ``python -m compose.generate EXPORT [--prompt TEXT | --chat]``.

Greedy by default (``--temperature T`` > 0 samples, with ``--top-p``, ``--top-k`` and ``--seed``); soft or gated
composition (``--composition``), each expert's weight overridable (``--weight calc=0.5``, repeatable). Tokens are
printed as they are decoded (:meth:`ComposedLM.generate` with a streamer). Where the tokenizer has a chat template,
the prompt is sent as one user turn (``--raw`` sends it as it is); ``--chat`` is an interactive conversation
(``/reset`` forgets it, ``/exit`` or end of input leaves). ``--show-intervals`` marks each expert's active spans
in the generated text (what its interval detector reads: docs/method.md, when the rule is exact): in colour on a terminal, as
``[name]…[/name]`` otherwise.

The helpers that load an export and turn text or a conversation into prompt ids live here too; the server
(:mod:`compose.frontends.serve`) uses the same ones.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TextIO

import torch

from compose.composed_lm import COMPOSITIONS, ComposedLM
from compose.intervals import IncrementalDetokenizer, IntervalTracker, token_decoder

PROG = "python -m compose.generate"
ANSI_COLOURS = (32, 34, 35, 33, 36, 31)  # green, blue, magenta, yellow, cyan, red: one per expert, in order
ANSI_RESET = "\x1b[0m"


# ---------------------------------------------------------------------- loading and prompts (shared with serve)


def parse_weights(items: Sequence[str], names: Sequence[str]) -> dict[str, float]:
    """``["calc=0.5", ...]`` to ``{"calc": 0.5}``; every name must be an expert of the export.

    Raises:
        ValueError: one line naming the item that is not ``NAME=FLOAT`` or the unknown expert.
    """
    weights: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition("=")
        try:
            weight = float(value)
        except ValueError:
            weight = None
        if not sep or not name or weight is None:
            raise ValueError(f"--weight {item!r}: expected NAME=FLOAT, e.g. calc=0.5")
        if name not in names:
            raise ValueError(f"--weight {item!r}: no expert {name!r} in the export (experts: {', '.join(names) or 'none'})")
        weights[name] = weight
    return weights


def apply_weights(composed: ComposedLM, weights: Mapping[str, float]) -> list[float]:
    """Set the weights of the named experts (the others keep theirs); returns the full list, in expert order."""
    composed.weights = [float(weights.get(n, w)) for n, w in zip(composed.names, composed.weights, strict=True)]
    return composed.weights


def load_composed(path: str | os.PathLike, *, composition: str = "soft", backend: str = "adapters",
                  device: str | None = None, weights: Mapping[str, float] | None = None) -> ComposedLM:
    """``ComposedLM.from_manifest`` (checksums verified) in eval mode, with ``weights`` applied.

    Raises:
        ValueError, FileNotFoundError: the export does not verify or load (the loader's one-line message).
    """
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    composed = ComposedLM.from_manifest(path, backend=backend, device=device, composition=composition)
    if composed.tokenizer is None:
        raise ValueError(f"{path}: the export has no tokenizer")
    apply_weights(composed, weights or {})
    return composed.eval()


def base_model(composed: ComposedLM):
    """The background's Hugging Face model (the base model of the adapters backend)."""
    return composed.model.get_base_model() if composed.backend == "adapters" else composed.background


def eos_token_ids(composed: ComposedLM) -> list[int]:
    """The ids that end a generation: the background's generation config's EOS, else the tokenizer's (as HF)."""
    config = getattr(base_model(composed), "generation_config", None)
    eos = None if config is None else config.eos_token_id
    if eos is None:
        eos = composed.tokenizer.eos_token_id
    return [] if eos is None else [int(e) for e in ([eos] if isinstance(eos, int) else eos)]


def pad_token_id(composed: ComposedLM) -> int:
    """What fills the rows of a batch that finished: the tokenizer's pad, else the first EOS, else 0."""
    pad = composed.tokenizer.pad_token_id
    if pad is None:
        eos = eos_token_ids(composed)
        pad = eos[0] if eos else 0
    return int(pad)


def context_length(composed: ComposedLM) -> int | None:
    """Positions the background can hold (its config's ``max_position_embeddings`` or an equivalent), if known."""
    config = base_model(composed).config
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def encode_text(tokenizer, text: str) -> list[int]:
    """Token ids of a prompt: the tokenizer's special tokens (e.g. BOS) added unless the text already starts with
    BOS (a rendered chat template often does), the rule of lm-eval's ``hf`` model."""
    bos = getattr(tokenizer, "bos_token", None)
    special = not (bos and text.startswith(bos))
    return list(tokenizer.encode(text, add_special_tokens=special))


def chat_text(tokenizer, messages: Sequence[Mapping[str, Any]]) -> str:
    """The tokenizer's chat template over ``messages``, ending with the assistant's turn to speak.

    Raises:
        ValueError: the tokenizer has no chat template, or the template refuses the messages.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template")
    import jinja2

    try:
        return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
    except jinja2.exceptions.TemplateError as err:
        raise ValueError(f"the chat template refused the messages: {err}") from None


# ---------------------------------------------------------------------- intervals on the terminal


class IntervalMarker:
    """Marks each expert's active spans in text read piece by piece.

    A character is in an expert's span when that expert's interval is open before it
    (:class:`compose.intervals.IntervalTracker`, the definition the gates and training masks share: the start
    delimiter is outside, the content and the end delimiter inside). ``colour=True`` paints the spans with ANSI
    colours (the first open expert's colour, underlined where several are open); otherwise each span is wrapped in
    ``[name]`` ... ``[/name]``.
    """

    def __init__(self, specs: Mapping[str, Mapping[str, Any]], colour: bool) -> None:
        self.trackers = {name: IntervalTracker(spec) for name, spec in specs.items()}
        self.colours = {name: ANSI_COLOURS[i % len(ANSI_COLOURS)] for i, name in enumerate(specs)}
        self.colour = colour
        self._open: tuple[str, ...] = ()

    def feed(self, text: str) -> str:
        """The marked form of the next piece of text."""
        out = []
        for ch in text:
            now = tuple(n for n, t in self.trackers.items() if t.is_open)
            if now != self._open:
                out.append(self._switch(self._open, now))
                self._open = now
            out.append(ch)
            for tracker in self.trackers.values():
                tracker.feed(ch)
        return "".join(out)

    def close(self) -> str:
        """Marks that end the spans still open at the end of the text."""
        end = self._switch(self._open, ())
        self._open = ()
        return end

    def legend(self) -> str:
        if self.colour:
            return "  ".join(f"\x1b[{self.colours[n]}m{n}{ANSI_RESET}" for n in self.trackers)
        return "  ".join(f"[{n}]...[/{n}]" for n in self.trackers)

    def _switch(self, before: tuple[str, ...], after: tuple[str, ...]) -> str:
        if self.colour:
            if not after:
                return ANSI_RESET if before else ""
            underline = ";4" if len(after) > 1 else ""
            return f"{ANSI_RESET}\x1b[{self.colours[after[0]]}{underline}m"
        closed = "".join(f"[/{n}]" for n in reversed(before) if n not in after)
        opened = "".join(f"[{n}]" for n in after if n not in before)
        return closed + opened


class TerminalStreamer:
    """A streamer for :meth:`ComposedLM.generate` (transformers' ``put``/``end`` interface) over one row.

    Skips the prompt, decodes the new tokens incrementally (special tokens skipped, characters held back while they
    may be an incomplete UTF-8 sequence, as the interval detectors read them) and writes each final piece to
    ``out``, through ``marker`` when given. ``text`` is what was written, unmarked.
    """

    def __init__(self, tokenizer, out: TextIO, marker: IntervalMarker | None = None,
                 eos_ids: Sequence[int] = ()) -> None:
        self.decode: Callable[[list[int]], str] = token_decoder(tokenizer)
        self.detok = IncrementalDetokenizer(self.decode)
        self.out, self.marker, self.eos_ids = out, marker, set(eos_ids)
        self.text = ""
        self._prompt_seen = False
        self._finished = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        token = int(value.reshape(-1)[0])
        if self._finished:
            return
        if token in self.eos_ids:  # the rest of the row is padding
            self._finished = True
            return
        self._write(self.detok.push(token))

    def end(self) -> None:
        rest = self.decode(self.detok.ids)[len(self.text):] if self.detok.ids else ""  # held-back invalid bytes
        self._write(rest)
        if self.marker is not None:
            self.out.write(self.marker.close())
        self.out.write("\n")
        self.out.flush()

    def _write(self, piece: str) -> None:
        if not piece:
            return
        self.text += piece
        self.out.write(self.marker.feed(piece) if self.marker is not None else piece)
        self.out.flush()


# ---------------------------------------------------------------------- generation


def generate_text(composed: ComposedLM, prompt_ids: Sequence[int], *, max_new_tokens: int, temperature: float = 0.0,
                  top_p: float | None = None, top_k: int | None = None, seed: int | None = None,
                  lazy: bool = False, streamer: Any = None) -> list[int]:
    """The generated token ids after ``prompt_ids`` (EOS and padding dropped); greedy when ``temperature`` is 0."""
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
    sample = temperature > 0
    generator = None
    if sample:
        generator = torch.Generator(device=composed.device)
        generator.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, ()).item()))
    eos = eos_token_ids(composed)
    out = composed.generate(
        ids, max_new_tokens=max_new_tokens, do_sample=sample, temperature=temperature if sample else 1.0,
        top_p=top_p, top_k=top_k, generator=generator, eos_token_id=eos, pad_token_id=pad_token_id(composed),
        lazy=lazy and composed.composition == "gated", streamer=streamer,
    )[0, ids.shape[1]:].tolist()
    for i, token in enumerate(out):
        if token in eos:
            return out[:i]
    return out


class Session:
    """One command-line conversation (or a single prompt) with a composed model."""

    def __init__(self, composed: ComposedLM, args: argparse.Namespace, out: TextIO) -> None:
        self.composed, self.args, self.out = composed, args, out
        self.tokenizer = composed.tokenizer
        self.templated = bool(getattr(self.tokenizer, "chat_template", None)) and not args.raw
        self.limit = context_length(composed)
        self.messages: list[dict[str, str]] = []
        self.transcript = ""  # the conversation as plain text where there is no chat template
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.args.system}] if self.args.system else []
        self.transcript = ""

    def prompt_ids(self, text: str) -> list[int]:
        if self.templated:
            return encode_text(self.tokenizer, chat_text(self.tokenizer, [*self.messages,
                                                                          {"role": "user", "content": text}]))
        return encode_text(self.tokenizer, self.transcript + text + ("\n" if self.args.chat else ""))

    def reply(self, text: str) -> str:
        """Generate (streaming to ``out``) the answer to ``text``; remember the turn in chat mode."""
        ids = self.prompt_ids(text)
        budget = self.args.max_new_tokens
        if self.limit is not None and len(ids) + budget > self.limit:
            if len(ids) >= self.limit:
                raise ValueError(f"the prompt has {len(ids)} tokens but the model holds {self.limit}"
                                 + ("; /reset starts a new conversation" if self.args.chat else ""))
            budget = self.limit - len(ids)
        marker = None
        if self.args.show_intervals:
            specs = {n: s["interval"] for n, s in zip(self.composed.names, self.composed.specs, strict=True)
                     if s.get("interval") is not None}
            marker = IntervalMarker(specs, colour=_use_colour(self.out, self.args.color))
        streamer = TerminalStreamer(self.tokenizer, self.out, marker, eos_token_ids(self.composed))
        generate_text(self.composed, ids, max_new_tokens=budget, temperature=self.args.temperature,
                      top_p=self.args.top_p, top_k=self.args.top_k, seed=self.args.seed, lazy=self.args.lazy,
                      streamer=streamer)
        if marker is not None and not self.args.chat:
            print(f"intervals: {marker.legend()}", file=sys.stderr)
        if self.args.chat:
            self.messages += [{"role": "user", "content": text}, {"role": "assistant", "content": streamer.text}]
            self.transcript += text + "\n" + streamer.text + "\n"
        return streamer.text


def _use_colour(out: TextIO, choice: str) -> bool:
    if choice != "auto":
        return choice == "always"
    return hasattr(out, "isatty") and out.isatty() and not os.environ.get("NO_COLOR")


def chat_loop(session: Session, stdin: TextIO, out: TextIO) -> None:
    """Read a line, answer it, until ``/exit`` or the end of input."""
    interactive = stdin.isatty()
    if interactive:
        experts = ", ".join(f"{n}={w:g}" for n, w in zip(session.composed.names, session.composed.weights,
                                                        strict=True)) or "no experts"
        print(f"{session.composed.composition} composition ({experts}); /reset forgets the conversation, "
              "/exit leaves", file=sys.stderr)
    while True:
        if interactive:
            out.write("> ")
            out.flush()
        line = stdin.readline()
        if not line:
            break
        text = line.rstrip("\n")
        if text.strip() == "/exit":
            break
        if text.strip() == "/reset":
            session.reset()
            continue
        if not text.strip():
            continue
        try:
            session.reply(text)
        except ValueError as err:
            print(f"error: {err}", file=sys.stderr)


# ---------------------------------------------------------------------- command line


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("export", help="export folder (composition.yaml)")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--prompt", help="generate once after this text (default: read it from standard input)")
    what.add_argument("--chat", action="store_true", help="an interactive conversation")
    p.add_argument("--composition", choices=COMPOSITIONS, default="soft")
    p.add_argument("--weight", action="append", default=[], metavar="NAME=W",
                   help="an expert's weight (repeatable; default: the export's)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None, help="seed of the sampler")
    p.add_argument("--system", default=None, help="a system message (chat template only)")
    p.add_argument("--raw", action="store_true", help="no chat template: the text is the prompt as it is")
    p.add_argument("--show-intervals", action="store_true", help="mark each expert's active spans")
    p.add_argument("--color", choices=("auto", "always", "never"), default="auto",
                   help="ANSI colours for --show-intervals (auto: on a terminal, unless NO_COLOR is set)")
    p.add_argument("--lazy", action="store_true", help="gated: run an expert only while its interval is open")
    p.add_argument("--backend", choices=("adapters", "separate"), default="adapters")
    p.add_argument("--device", default=None)
    return p


def _check_args(args: argparse.Namespace) -> None:
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.temperature < 0:
        raise ValueError(f"--temperature must be >= 0, got {args.temperature}")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise ValueError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.top_k is not None and args.top_k < 0:
        raise ValueError(f"--top-k must be >= 0, got {args.top_k}")


def main(argv: Sequence[str] | None = None, stdin: TextIO | None = None, stdout: TextIO | None = None) -> int:
    """Run the command; exit 2 with one line on bad input (an export that does not verify, an unknown expert)."""
    args = _parser().parse_args(argv)
    stdin, out = stdin or sys.stdin, stdout or sys.stdout
    try:
        _check_args(args)
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        composed = load_composed(args.export, composition=args.composition, backend=args.backend,
                                 device=args.device)
        apply_weights(composed, parse_weights(args.weight, composed.names))
        session = Session(composed, args, out)
        if args.chat:
            chat_loop(session, stdin, out)
            return 0
        prompt = args.prompt if args.prompt is not None else stdin.read()
        if not prompt:
            raise ValueError("empty prompt: pass --prompt TEXT, --chat, or text on standard input")
        session.reply(prompt)
    except (ValueError, FileNotFoundError) as err:
        print(f"compose.generate: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    return 0
