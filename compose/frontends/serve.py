"""An OpenAI-compatible HTTP server over a composed export: ``python -m compose.serve EXPORT``.

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (and ``GET /health``).
Requests take the OpenAI fields ``max_tokens``, ``temperature`` (0 = greedy), ``top_p``, ``seed``, ``stop``, ``n``,
``stream`` (server-sent events, ``stream_options.include_usage``), ``logprobs`` (completions: top-N per token;
with ``echo`` the prompt's tokens are scored too, which is how lm-eval's ``local-completions`` model reads
log-likelihoods; chat: ``logprobs`` + ``top_logprobs``), and three extensions: ``top_k``, ``ignore_eos`` and
``composition: {mode: soft|gated, weights: {expert: w}}`` (per request; unnamed experts keep the export's weight).

Batching: a worker thread owns the model; requests that arrive together (within ``--batch-wait-ms`` of the
first, or while a batch decodes) and share their composition and sampling settings run as one
:meth:`ComposedLM.generate` call of up to ``--max-batch-size`` rows, each row stopped on its own (its EOS, its
``stop`` strings, its ``max_tokens``, or its client leaving) by a ``stopping_criteria``; echoed prompts are
scored together by :meth:`ComposedLM.score`. A row that stops early, or whose client disconnects, no longer
decodes; a request that arrives while a batch decodes joins the next one.

Why FastAPI and uvicorn: they are what the field's OpenAI-compatible servers (vLLM's, SGLang's) run on, so
clients meet the behaviour they expect (SSE streaming, disconnects, keep-alive); pydantic models validate each
request and document it (``/docs``); the asyncio loop only parses and streams, the model runs on its own thread.

Errors use OpenAI's format (``{"error": {"message", "type", "param", "code"}}``): 400 for a malformed body, a bad
value or a prompt plus ``max_tokens`` longer than the model's context, 401 for a missing or wrong key, 404 for an
unknown model, 500 for a failure inside the model (the server keeps serving). At start-up, a port in use or an
export that does not verify is one line on stderr and exit status 2.

Security: it listens on 127.0.0.1 unless ``--host`` says otherwise; ``--api-key`` (or ``COMPOSE_API_KEY``)
requires ``Authorization: Bearer KEY`` on every ``/v1`` route.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import json
import os
import socket
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from compose.composed_lm import COMPOSITIONS, ComposedLM
from compose.frontends.generate import (
    apply_weights,
    chat_text,
    context_length,
    encode_text,
    eos_token_ids,
    load_composed,
    pad_token_id,
    parse_weights,
)
from compose.intervals import IncrementalDetokenizer, token_decoder

PROG = "python -m compose.serve"
API_KEY_ENV = "COMPOSE_API_KEY"
MAX_LOGPROBS = 20
SCORE_BYTES = 1 << 28  # float32 log-probs of one scoring call of echoed prompts (256 MiB)


class APIError(Exception):
    """An error answered in OpenAI's format."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


# ---------------------------------------------------------------------- the engine: batches on a worker thread


@dataclass(frozen=True)
class Settings:
    """What the rows of one batch share: the composition and the sampler."""

    mode: str
    weights: tuple[float, ...]
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    ignore_eos: bool = False
    alone: int | None = None  # a seeded sampled request runs alone, so its seed reproduces it

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(eq=False)
class Job:
    """One completion: a prompt's ids and what to do with them. The worker fills the results and reports through
    ``report(index, event, payload)`` (called on the worker thread)."""

    prompt: list[int]
    max_tokens: int
    settings: Settings
    stop: tuple[str, ...] = ()
    logprobs: int | None = None  # top-N for the generated tokens
    echo_logprobs: int | None = None  # top-N for the prompt's tokens (echo + logprobs)
    index: int = 0
    report: Any = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    # results
    tokens: list[int] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_logprobs: list[float | None] = field(default_factory=list)
    prompt_top: list[list[tuple[int, float]] | None] = field(default_factory=list)
    next_logprobs: torch.Tensor | None = None  # after an echoed prompt: the log-probs of the token that follows
    text: str = ""
    finish_reason: str | None = None
    arrived: float = 0.0

    def emit(self, event: str, payload: Any = None) -> None:
        if self.report is not None:
            self.report(self.index, event, payload)


def _top(lp: torch.Tensor, n: int, chosen: int) -> list[tuple[int, float]]:
    """The ``n`` likeliest tokens of one log-prob row, and the chosen one, as ``(id, logprob)``."""
    values, ids = lp.topk(n) if n > 0 else (lp[:0], lp[:0].long())
    top = list(zip(ids.tolist(), values.tolist(), strict=True))
    if chosen not in ids.tolist():
        top.append((chosen, float(lp[chosen])))
    return top


class _Row:
    """One row of a ``generate`` batch: decodes its tokens, applies its stop strings and ``max_tokens``, streams."""

    def __init__(self, job: Job, decode, eos: set[int]) -> None:
        self.job, self.decode, self.eos = job, decode, eos
        self.detok = IncrementalDetokenizer(decode)
        self.longest_stop = max((len(s) for s in job.stop), default=0)
        self.sent = 0  # characters of the text streamed so far
        self.sent_tokens = 0

    def step(self, token: int, lp: torch.Tensor | None) -> None:
        job = self.job
        if job.cancelled.is_set():
            job.finish_reason = "cancelled"
            return
        job.tokens.append(token)
        if job.logprobs is not None and lp is not None:
            job.token_logprobs.append(float(lp[token]))
            job.top_logprobs.append(_top(lp, job.logprobs, token))
        if token in self.eos:
            job.finish_reason = "stop"
        else:
            piece = self.detok.push(token)
            job.text += piece
            if piece and self.longest_stop and self._cut(len(job.text) - len(piece)):
                job.finish_reason = "stop"
        if job.finish_reason is None and len(job.tokens) >= job.max_tokens:
            job.finish_reason = "length"
        if job.finish_reason is not None:
            self.finish()
        else:
            self._send(len(job.text) - self._held_back())

    def finish(self) -> None:
        """Decode what was held back (an incomplete UTF-8 tail), send the rest of the text and the end."""
        job = self.job
        if job.finish_reason == "cancelled":
            return
        if job.finish_reason == "length" or (job.tokens and job.tokens[-1] in self.eos):
            ids = [t for t in job.tokens if t not in self.eos]
            full = self.decode(ids) if ids else ""
            if full.startswith(job.text):
                job.text = full
                if self._cut(0):
                    job.finish_reason = "stop"
        job.finish_reason = job.finish_reason or "length"
        self._send(len(job.text))
        job.emit("done")

    def _cut(self, start: int) -> bool:
        """Cut the text before the first stop string that ends after ``start``; True when one was found."""
        text = self.job.text
        window = max(0, start - self.longest_stop + 1)
        found = [i for i in (text.find(s, window) for s in self.job.stop) if i >= 0]
        if not found:
            return False
        self.job.text = text[: min(found)]
        return True

    def _held_back(self) -> int:
        """Characters at the end of the text that may begin a stop string (not streamed yet)."""
        text = self.job.text
        for n in range(min(self.longest_stop - 1, len(text)), 0, -1):
            if any(s.startswith(text[-n:]) for s in self.job.stop):
                return n
        return 0

    def _send(self, upto: int) -> None:
        """Stream ``text[sent:upto]`` with the tokens not streamed yet (their index of the first, for logprobs)."""
        job = self.job
        if upto > self.sent or len(job.tokens) > self.sent_tokens:
            job.emit("delta", (job.text[self.sent: upto] if upto > self.sent else "", self.sent_tokens))
            self.sent = max(self.sent, upto)
            self.sent_tokens = len(job.tokens)


class _RowControl:
    """``stopping_criteria`` of one ``generate`` batch: steps every unfinished row, says which rows are done."""

    def __init__(self, rows: list[_Row], want_logprobs: bool) -> None:
        self.rows, self.want_logprobs = rows, want_logprobs
        self.steps = 0

    def __call__(self, sequences: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        tokens = sequences[:, -1].tolist()
        lps = scores.float().log_softmax(-1).cpu() if self.want_logprobs else None
        for i, row in enumerate(self.rows):
            if row.job.finish_reason is None:
                row.step(tokens[i], None if lps is None else lps[i])
        return torch.tensor([row.job.finish_reason is not None for row in self.rows])


class Engine:
    """Owns a :class:`ComposedLM` and runs :class:`Job` s in batches on one worker thread.

    Args:
        composed: the model (with its tokenizer), in eval mode.
        max_batch_size: rows per ``generate`` call.
        batch_wait: seconds the worker waits, after the first job of a batch arrives, for others to join it.
        max_model_len: the context (prompt plus generated tokens) a request may ask for (default: the
            background's, see :func:`compose.frontends.generate.context_length`).
    """

    def __init__(self, composed: ComposedLM, *, max_batch_size: int = 16, batch_wait: float = 0.005,
                 max_model_len: int | None = None) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size}")
        self.composed = composed.eval()
        self.tokenizer = composed.tokenizer
        self.max_batch_size, self.batch_wait = int(max_batch_size), float(batch_wait)
        self.max_model_len = max_model_len or context_length(composed) or 2048
        self.vocab_size = len(self.tokenizer)
        self.eos = set(eos_token_ids(composed))
        self.pad = pad_token_id(composed)
        self.decode = token_decoder(self.tokenizer)
        self.default_weights = tuple(composed.weights)
        self.default_mode = composed.composition
        self.stats = {"batches": 0, "rows": 0, "largest_batch": 0, "cancelled": 0, "steps": 0, "errors": 0}
        self._pending: deque[Job] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._running = False
        self._token_text: dict[int, str] = {}
        self._thread = threading.Thread(target=self._work, name="compose-serve-engine", daemon=True)
        self._thread.start()

    # -------------------------------------------------------------- the request side

    def settings(self, composition: Mapping[str, Any] | None, temperature: float, top_p: float,
                 top_k: int | None, seed: int | None, ignore_eos: bool) -> Settings:
        """A request's :class:`Settings`; raises :class:`APIError` (400) naming a bad mode or expert."""
        mode, weights = self.default_mode, dict(zip(self.composed.names, self.default_weights, strict=True))
        if composition:
            unknown = sorted(set(composition) - {"mode", "weights"})
            if unknown:
                raise APIError(400, f"composition: unknown key(s) {unknown} (allowed: mode, weights)", "composition")
            mode = composition.get("mode") or mode
            if mode not in COMPOSITIONS:
                raise APIError(400, f"composition.mode must be one of {list(COMPOSITIONS)}, got {mode!r}",
                               "composition.mode")
            given = composition.get("weights") or {}
            if not isinstance(given, Mapping):
                raise APIError(400, "composition.weights must be an object {expert: weight}", "composition.weights")
            for name, w in given.items():
                if name not in weights:
                    raise APIError(400, f"composition.weights: no expert {name!r} (experts: "
                                        f"{', '.join(self.composed.names) or 'none'})", "composition.weights")
                if isinstance(w, bool) or not isinstance(w, (int, float)):
                    raise APIError(400, f"composition.weights.{name} must be a number, got {w!r}",
                                   "composition.weights")
                weights[name] = float(w)
        greedy = temperature == 0
        return Settings(mode=mode, weights=tuple(weights[n] for n in self.composed.names),
                        temperature=float(temperature), top_p=1.0 if greedy else float(top_p),
                        top_k=None if greedy else top_k, seed=None if greedy else seed, ignore_eos=bool(ignore_eos),
                        alone=None if greedy or seed is None else uuid.uuid4().int)

    def check_length(self, prompt: Sequence[int], max_tokens: int) -> None:
        """400 unless the prompt and ``max_tokens`` fit in the context and every id is in the vocabulary."""
        if not prompt:
            raise APIError(400, "the prompt is empty (it must have at least one token)", "prompt")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})", "prompt")
        if len(prompt) + max_tokens > self.max_model_len:
            raise APIError(
                400, f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                     f"{len(prompt) + max_tokens} tokens ({len(prompt)} in the prompt, {max_tokens} for the "
                     "completion). Please reduce the prompt or max_tokens.", "max_tokens", "context_length_exceeded")

    def submit(self, jobs: Sequence[Job]) -> None:
        with self._cond:
            if self._closed:
                raise APIError(503, "the server is shutting down", kind="server_error")
            now = time.monotonic()
            for job in jobs:
                job.arrived = now
            self._pending.extend(jobs)
            self._cond.notify()

    def cancel(self, jobs: Sequence[Job]) -> None:
        """Free the places of jobs whose client left: dropped if still queued, stopped at the next step if running."""
        with self._cond:
            for job in jobs:
                if job.finish_reason is None and not job.cancelled.is_set():
                    job.cancelled.set()
                    self.stats["cancelled"] += 1
                    with contextlib.suppress(ValueError):
                        self._pending.remove(job)

    def token_text(self, token: int) -> str:
        """A token as text (special tokens too), as the ``tokens`` of ``logprobs`` show it."""
        text = self._token_text.get(token)
        if text is None:
            text = self._token_text[token] = self.tokenizer.decode([token], skip_special_tokens=False)
        return text

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=60)

    # -------------------------------------------------------------- the worker side

    def _next_batch(self) -> list[Job] | None:
        with self._cond:
            while not self._pending and not self._closed:
                self._cond.wait()
            if self._closed:
                return None
            deadline = self._pending[0].arrived + self.batch_wait
            while len(self._pending) < self.max_batch_size and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)
            first = self._pending[0].settings
            batch = [job for job in self._pending if job.settings == first][: self.max_batch_size]
            for job in batch:
                self._pending.remove(job)
            self._running = True
            return batch

    def busy(self) -> bool:
        """Whether a batch is running or jobs are waiting."""
        with self._cond:
            return self._running or bool(self._pending)

    def _work(self) -> None:
        torch.set_grad_enabled(False)
        while (batch := self._next_batch()) is not None:
            batch = [job for job in batch if not job.cancelled.is_set()]
            try:
                if batch:
                    self._run(batch)
            except Exception as err:  # noqa: BLE001  (answered to the clients; the worker keeps serving)
                self.stats["errors"] += 1
                message = " ".join(f"{type(err).__name__}: {err}".split())
                for job in batch:
                    if job.finish_reason is None:
                        job.finish_reason = "error"
                        job.emit("error", message)
            finally:
                with self._cond:
                    self._running = False

    @contextlib.contextmanager
    def _composition(self, settings: Settings) -> Iterator[None]:
        composed = self.composed
        saved = (composed.composition, list(composed.weights))
        composed.composition = settings.mode
        apply_weights(composed, dict(zip(composed.names, settings.weights, strict=True)))
        try:
            yield
        finally:
            composed.composition, composed.weights = saved

    def _run(self, batch: list[Job]) -> None:
        settings = batch[0].settings
        self.stats["batches"] += 1
        self.stats["rows"] += len(batch)
        self.stats["largest_batch"] = max(self.stats["largest_batch"], len(batch))
        with self._composition(settings):
            scored = [job for job in batch if job.echo_logprobs is not None]
            if scored:
                self._score(scored)
            decoding = []
            for job in batch:
                if job.max_tokens == 0 or job.cancelled.is_set():
                    job.finish_reason = "cancelled" if job.cancelled.is_set() else "length"
                    if job.finish_reason == "length":
                        job.emit("done")
                elif settings.greedy and job.max_tokens == 1 and job.next_logprobs is not None:
                    self._first_token_from_score(job)  # the scored prompt's last position already is that step
                else:
                    decoding.append(job)
            if decoding:
                self._generate(decoding, settings)

    def _first_token_from_score(self, job: Job) -> None:
        lp = job.next_logprobs
        _Row(job, self.decode, set() if job.settings.ignore_eos else self.eos).step(int(lp.argmax()), lp)

    def _score(self, jobs: list[Job]) -> None:
        """Composed log-probs of each echoed prompt's tokens (the first has none), and of the next token."""
        composed = self.composed
        longest = max(len(job.prompt) for job in jobs)
        per_call = max(1, SCORE_BYTES // (4 * longest * self.vocab_size * max(1, composed.num_experts + 1)))
        for start in range(0, len(jobs), per_call):
            chunk = jobs[start: start + per_call]
            width = max(len(job.prompt) for job in chunk)
            ids = torch.full((len(chunk), width), self.pad, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, job in enumerate(chunk):
                ids[i, : len(job.prompt)] = torch.tensor(job.prompt)
                mask[i, : len(job.prompt)] = 1
            masks = None
            if composed.composition == "gated" and composed.num_experts:
                # the gates read what is generated: over a prompt they are closed, as in generate
                masks = torch.ones(composed.num_experts, len(chunk), width, dtype=torch.bool)
                for i, job in enumerate(chunk):
                    t = len(job.prompt)
                    masks[:, i, :t] = composed.interval_masks(torch.tensor([job.prompt]), t)[:, 0].cpu()
            lps = composed.score(ids.to(composed.device), mask.to(composed.device), masks=masks).cpu()
            for i, job in enumerate(chunk):
                t = len(job.prompt)
                lp = lps[i, :t]
                targets = torch.tensor(job.prompt[1:])
                picked = lp[:-1].gather(-1, targets[:, None])[:, 0].tolist() if t > 1 else []
                job.prompt_logprobs = [None, *picked]
                job.prompt_top = [None] + [_top(lp[j], job.echo_logprobs, job.prompt[j + 1]) for j in range(t - 1)]
                job.next_logprobs = lp[t - 1]

    def _generate(self, jobs: list[Job], settings: Settings) -> None:
        composed = self.composed
        width = max(len(job.prompt) for job in jobs)
        ids = torch.full((len(jobs), width), self.pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, job in enumerate(jobs):  # left padding
            ids[i, width - len(job.prompt):] = torch.tensor(job.prompt)
            mask[i, width - len(job.prompt):] = 1
        eos = set() if settings.ignore_eos else self.eos
        rows = [_Row(job, self.decode, eos) for job in jobs]
        control = _RowControl(rows, want_logprobs=any(job.logprobs is not None for job in jobs))
        generator = None
        if not settings.greedy:
            generator = torch.Generator(device=composed.device)
            seed = settings.seed if settings.seed is not None else int(torch.randint(0, 2**62, ()).item())
            generator.manual_seed(seed)
        composed.generate(
            ids.to(composed.device), mask.to(composed.device),
            max_new_tokens=max(job.max_tokens for job in jobs), do_sample=not settings.greedy,
            temperature=settings.temperature if not settings.greedy else 1.0, top_p=settings.top_p,
            top_k=settings.top_k, generator=generator, eos_token_id=sorted(eos), pad_token_id=self.pad,
            stopping_criteria=control,
        )
        self.stats["steps"] += control.steps
        for row in rows:  # rows generate stopped without the criteria (never, unless max_new_tokens ran out)
            if row.job.finish_reason is None:
                row.job.finish_reason = "length"
                row.finish()


# ---------------------------------------------------------------------- request bodies (OpenAI's fields)


class CompositionOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mode: Literal["soft", "gated"] | None = None
    weights: dict[str, float] | None = None


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")  # fields other servers accept are ignored, as OpenAI's clients send them

    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    n: int = Field(1, ge=1, le=64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    composition: CompositionOptions | None = None

    def stops(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return tuple(s for s in stops if s)

    def check_supported(self) -> None:
        for key in ("presence_penalty", "frequency_penalty"):
            if getattr(self, key):
                raise APIError(400, f"{key} is not supported by this server", key)
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported by this server", "logit_bias")


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


# ---------------------------------------------------------------------- the app


def build_app(engine: Engine, *, model_name: str, api_key: str | None = None) -> FastAPI:
    """The FastAPI application serving ``engine`` as the model ``model_name`` (bearer ``api_key`` if given)."""
    app = FastAPI(title="compose.serve", version="1", summary=f"OpenAI-compatible server of {model_name}")
    app.state.engine = engine
    _add_error_handlers(app)
    created = int(time.time())
    authorized = [Depends(_authorizer(api_key))]

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models", dependencies=authorized)
    async def models() -> dict:
        return {"object": "list", "data": [_model_card(engine, model_name, created)]}

    @app.get("/v1/models/{model_id}", dependencies=authorized)
    async def model(model_id: str) -> dict:
        _check_model(model_id, model_name)
        return _model_card(engine, model_name, created)

    @app.post("/v1/completions", dependencies=authorized)
    async def completions(body: CompletionRequest, request: Request):
        _check_model(body.model, model_name)
        call = _Call(engine, _completion_jobs(engine, body), request)
        if body.stream:
            return _sse(_completion_chunks(call, body, model_name))
        await call.wait()
        return _completion_response(call, body, model_name)

    @app.post("/v1/chat/completions", dependencies=authorized)
    async def chat(body: ChatRequest, request: Request):
        _check_model(body.model, model_name)
        call = _Call(engine, _chat_jobs(engine, body), request)
        if body.stream:
            return _sse(_chat_chunks(call, body, model_name))
        await call.wait()
        return _chat_response(call, body, model_name)

    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Answer every error in OpenAI's format: the API's own, a malformed body, an unknown route or method, a crash."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        return JSONResponse(_validation_error(err).body(), status_code=400)

    @app.exception_handler(404)
    async def _not_found(request: Request, err: Exception) -> JSONResponse:
        return JSONResponse(APIError(404, f"no route {request.url.path}").body(), status_code=404)

    @app.exception_handler(405)
    async def _method(request: Request, err: Exception) -> JSONResponse:
        message = f"method {request.method} is not allowed on {request.url.path}"
        return JSONResponse(APIError(405, message).body(), status_code=405)

    @app.exception_handler(Exception)
    async def _internal(request: Request, err: Exception) -> JSONResponse:
        message = " ".join(f"{type(err).__name__}: {err}".split())
        return JSONResponse(APIError(500, message, kind="server_error").body(), status_code=500)


def _authorizer(api_key: str | None) -> Callable[[Request], None]:
    """The dependency of the ``/v1`` routes: 401 unless ``Authorization: Bearer api_key`` (anything without a key)."""

    def authorize(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), api_key.encode()):
            raise APIError(401, "Incorrect or missing API key: send Authorization: Bearer <key>", code="invalid_api_key")

    return authorize


def _check_model(name: str | None, model_name: str) -> None:
    if name is not None and name != model_name:
        raise APIError(404, f"The model `{name}` does not exist (this server serves `{model_name}`)", "model",
                       "model_not_found")


def _model_card(engine: Engine, model_name: str, created: int) -> dict:
    return {"id": model_name, "object": "model", "created": created, "owned_by": "compose",
            "max_model_len": engine.max_model_len, "experts": list(engine.composed.names),
            "weights": list(engine.default_weights), "composition": engine.default_mode}


def _completion_jobs(engine: Engine, body: CompletionRequest) -> list[Job]:
    """The jobs of a completion request: ``n`` per prompt, indexed prompt by prompt; 400 for what is not served."""
    body.check_supported()
    if body.suffix:
        raise APIError(400, "suffix is not supported by this server", "suffix")
    if body.best_of not in (None, 1):
        raise APIError(400, "best_of is not supported by this server", "best_of")
    settings = _settings(engine, body)
    prompts = _prompts(engine, body.prompt)
    max_tokens = 16 if body.max_tokens is None else body.max_tokens
    if max_tokens == 0 and not body.echo:
        raise APIError(400, "max_tokens must be at least 1 (0 only with echo)", "max_tokens")
    echo_logprobs = body.logprobs if body.echo and body.logprobs is not None else None
    jobs = []
    for p, prompt in enumerate(prompts):
        engine.check_length(prompt, max_tokens)
        for j in range(body.n):
            jobs.append(Job(prompt, max_tokens, settings, body.stops(), logprobs=body.logprobs,
                            echo_logprobs=echo_logprobs, index=p * body.n + j))
    return jobs


def _chat_jobs(engine: Engine, body: ChatRequest) -> list[Job]:
    """The ``n`` jobs of a chat request over its templated messages (default ``max_tokens``: the rest of the context)."""
    body.check_supported()
    settings = _settings(engine, body)
    messages = [_chat_message(m, i) for i, m in enumerate(body.messages)]
    try:
        prompt = encode_text(engine.tokenizer, chat_text(engine.tokenizer, messages))
    except ValueError as err:
        raise APIError(400, f"{err}; use /v1/completions", "messages") from None
    limit = body.max_completion_tokens or body.max_tokens
    max_tokens = limit if limit is not None else max(1, engine.max_model_len - len(prompt))
    engine.check_length(prompt, max_tokens)
    top = (body.top_logprobs or 0) if body.logprobs else None
    return [Job(prompt, max_tokens, settings, body.stops(), logprobs=top, index=j) for j in range(body.n)]


def _validation_error(err: RequestValidationError) -> APIError:
    first = err.errors()[0] if err.errors() else {}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    if first.get("type") == "json_invalid":
        return APIError(400, f"malformed JSON body: {first.get('msg', 'invalid JSON')}", code="invalid_json")
    where = ".".join(loc) or "body"
    return APIError(400, f"{where}: {first.get('msg', 'invalid value')}", where)


def _settings(engine: Engine, body: _Common) -> Settings:
    composition = None if body.composition is None else body.composition.model_dump(exclude_none=True)
    return engine.settings(composition, body.temperature, body.top_p, body.top_k, body.seed, body.ignore_eos)


def _prompts(engine: Engine, prompt: Any) -> list[list[int]]:
    """A completion request's prompt(s) as token ids: a string, strings, ids, or lists of ids."""
    if isinstance(prompt, str):
        return [encode_text(engine.tokenizer, prompt)]
    if not prompt:
        raise APIError(400, "the prompt is empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return [encode_text(engine.tokenizer, p) if isinstance(p, str) else list(p) for p in prompt]


def _chat_message(message: ChatMessage, i: int) -> dict[str, str]:
    content = message.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(400, f"messages[{i}].content: only text parts are supported", f"messages.{i}.content")
            texts.append(part["text"])
        content = "".join(texts)
    return {"role": message.role, "content": content or ""}


class _Call:
    """The jobs of one request, their events, and the client's presence."""

    def __init__(self, engine: Engine, jobs: list[Job], request: Request) -> None:
        self.engine, self.jobs, self.request = engine, jobs, request
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        for job in jobs:
            job.report = self._report

    def _report(self, index: int, event: str, payload: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: the server stopped
            self.loop.call_soon_threadsafe(self.events.put_nowait, (index, event, payload))

    async def stream(self) -> AsyncIterator[tuple[int, str, Any]]:
        """Submit the jobs and yield their events until every job ended; a client that leaves cancels them."""
        self.engine.submit(self.jobs)
        open_jobs = len(self.jobs)
        try:
            while open_jobs:
                index, event, payload = await self.events.get()
                if event == "error":
                    raise APIError(500, payload, kind="server_error")
                if event == "done":
                    open_jobs -= 1
                yield index, event, payload
        finally:
            self.engine.cancel(self.jobs)  # no-op for finished jobs

    async def wait(self) -> None:
        """Run the jobs to the end (non-streaming); stop them if the client disconnects meanwhile."""
        consume = asyncio.ensure_future(self._consume())
        watcher = asyncio.ensure_future(self._disconnected())
        try:
            done, _ = await asyncio.wait({consume, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if consume in done:
                consume.result()  # an APIError of the batch is raised here
                return
            consume.cancel()  # runs stream()'s clean-up: the jobs are cancelled
            with contextlib.suppress(asyncio.CancelledError):
                await consume
            raise APIError(499, "the client disconnected")
        finally:
            watcher.cancel()

    async def _consume(self) -> None:
        async for _ in self.stream():
            pass

    async def _disconnected(self) -> None:
        while not await self.request.is_disconnected():
            await asyncio.sleep(0.1)


def _sse(chunks: AsyncIterator[dict]) -> StreamingResponse:
    async def body() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
        except APIError as err:
            yield f"data: {json.dumps(err.body())}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _usage(jobs: Sequence[Job]) -> dict:
    prompt = sum(len(job.prompt) for job in {id(j.prompt): j for j in jobs}.values())
    completion = sum(len(job.tokens) for job in jobs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _finish(job: Job) -> str:
    return "length" if job.finish_reason in (None, "length") else "stop"


def _completion_logprobs(engine: Engine, job: Job, first: int = 0, echo: bool = False) -> dict:
    """OpenAI's completion ``logprobs`` object of the generated tokens ``first:`` (with the prompt's, on echo)."""
    ids, lps, tops = [], [], []
    if echo:
        ids, lps, tops = list(job.prompt), list(job.prompt_logprobs), list(job.prompt_top)
    ids += job.tokens[first:]
    lps += job.token_logprobs[first:]
    tops += job.top_logprobs[first:]
    tokens = [engine.token_text(t) for t in ids]
    offsets, at = [], 0
    for text in tokens:
        offsets.append(at)
        at += len(text)
    top_dicts = []
    for top in tops:
        if top is None:
            top_dicts.append(None)
            continue
        entry: dict[str, float] = {}
        for token, lp in top:
            text = engine.token_text(token)
            entry[text] = max(lp, entry.get(text, float("-inf")))
        top_dicts.append(entry)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": top_dicts, "text_offset": offsets}


def _chat_logprobs(engine: Engine, job: Job, first: int = 0) -> dict:
    def item(token: int, lp: float) -> dict:
        text = engine.token_text(token)
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

    content = []
    for token, lp, top in zip(job.tokens[first:], job.token_logprobs[first:], job.top_logprobs[first:], strict=True):
        # `top` is the top-N, then the chosen token where it is not among them
        content.append({**item(token, lp), "top_logprobs": [item(t, v) for t, v in top[: job.logprobs or 0]]})
    return {"content": content}


def _completion_response(call: _Call, body: CompletionRequest, model_name: str) -> dict:
    engine, choices = call.engine, []
    for job in sorted(call.jobs, key=lambda j: j.index):
        text = job.text
        if body.echo:
            text = engine.decode(job.prompt) + text
        logprobs = None
        if body.logprobs is not None:
            logprobs = _completion_logprobs(engine, job, echo=body.echo)
        choices.append({"index": job.index, "text": text, "logprobs": logprobs, "finish_reason": _finish(job)})
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": model_name, "choices": choices, "usage": _usage(call.jobs)}


async def _completion_chunks(call: _Call, body: CompletionRequest, model_name: str) -> AsyncIterator[dict]:
    engine = call.engine
    base = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": model_name}
    jobs = {job.index: job for job in call.jobs}
    if body.echo:
        for job in call.jobs:
            yield {**base, "choices": [{"index": job.index, "text": engine.decode(job.prompt), "logprobs": None,
                                        "finish_reason": None}]}
    async for index, event, payload in call.stream():
        job = jobs[index]
        if event == "delta":
            text, first = payload
            logprobs = _completion_logprobs(engine, job, first) if body.logprobs is not None else None
            yield {**base, "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": None}]}
        elif event == "done":
            yield {**base, "choices": [{"index": index, "text": "", "logprobs": None, "finish_reason": _finish(job)}]}
    if body.stream_options is not None and body.stream_options.include_usage:
        yield {**base, "choices": [], "usage": _usage(call.jobs)}


def _chat_response(call: _Call, body: ChatRequest, model_name: str) -> dict:
    choices = []
    for job in sorted(call.jobs, key=lambda j: j.index):
        logprobs = _chat_logprobs(call.engine, job) if body.logprobs else None
        choices.append({"index": job.index, "message": {"role": "assistant", "content": job.text},
                        "logprobs": logprobs, "finish_reason": _finish(job)})
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": model_name, "choices": choices, "usage": _usage(call.jobs)}


async def _chat_chunks(call: _Call, body: ChatRequest, model_name: str) -> AsyncIterator[dict]:
    base = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk", "created": int(time.time()),
            "model": model_name}
    jobs = {job.index: job for job in call.jobs}
    for job in call.jobs:
        yield {**base, "choices": [{"index": job.index, "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None, "finish_reason": None}]}
    async for index, event, payload in call.stream():
        job = jobs[index]
        if event == "delta":
            text, first = payload
            logprobs = _chat_logprobs(call.engine, job, first) if body.logprobs else None
            yield {**base, "choices": [{"index": index, "delta": {"content": text}, "logprobs": logprobs,
                                        "finish_reason": None}]}
        elif event == "done":
            yield {**base, "choices": [{"index": index, "delta": {}, "logprobs": None,
                                        "finish_reason": _finish(job)}]}
    if body.stream_options is not None and body.stream_options.include_usage:
        yield {**base, "choices": [], "usage": _usage(call.jobs)}


# ---------------------------------------------------------------------- running it


def listening_socket(host: str, port: int) -> socket.socket:
    """A bound TCP socket (``port`` 0: a free one); raises ``OSError`` when the address is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets that say so, and without it each streamed
    # chunk on a kept-alive connection can wait ~40 ms for the client's delayed ACK
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


@contextlib.contextmanager
def running_server(app: FastAPI, host: str = "127.0.0.1", port: int = 0,
                   log_level: str = "warning") -> Iterator[str]:
    """Serve ``app`` with uvicorn on a thread of this process; yields the base URL (``http://host:port``)."""
    import uvicorn

    sock = listening_socket(host, port)
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("export", help="export folder (composition.yaml)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help=f"require Authorization: Bearer KEY (default: the environment variable {API_KEY_ENV})")
    p.add_argument("--model-name", default=None, help="the model's name in the API (default: the export folder's)")
    p.add_argument("--composition", choices=COMPOSITIONS, default="soft", help="default composition of requests")
    p.add_argument("--weight", action="append", default=[], metavar="NAME=W",
                   help="an expert's default weight (repeatable; default: the export's)")
    p.add_argument("--max-batch-size", type=int, default=16)
    p.add_argument("--batch-wait-ms", type=float, default=5.0,
                   help="how long the first request of a batch waits for others to join it")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt plus max_tokens (default: the background's context)")
    p.add_argument("--backend", choices=("adapters", "separate"), default="adapters")
    p.add_argument("--device", default=None)
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Serve until interrupted; exit 2 with one line when the port is taken or the export does not load."""
    import uvicorn

    args = _parser().parse_args(argv)
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    try:
        if not 0 <= args.port <= 65535:
            raise ValueError(f"--port must be in 0..65535, got {args.port}")
        if args.max_batch_size < 1:
            raise ValueError(f"--max-batch-size must be at least 1, got {args.max_batch_size}")
        if args.max_model_len is not None and args.max_model_len < 2:
            raise ValueError(f"--max-model-len must be at least 2, got {args.max_model_len}")
        try:
            sock = listening_socket(args.host, args.port)
        except OSError as err:
            raise ValueError(f"cannot listen on {args.host}:{args.port}: {err.strerror or err}") from None
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        composed = load_composed(args.export, composition=args.composition, backend=args.backend,
                                 device=args.device)
        apply_weights(composed, parse_weights(args.weight, composed.names))
    except (ValueError, FileNotFoundError) as err:
        print(f"compose.serve: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    engine = Engine(composed, max_batch_size=args.max_batch_size, batch_wait=args.batch_wait_ms / 1000,
                    max_model_len=args.max_model_len)
    name = args.model_name or Path(args.export).resolve().name
    app = build_app(engine, model_name=name, api_key=api_key)
    where = f"http://{args.host}:{sock.getsockname()[1]}/v1"
    print(f"compose.serve: {name} ({composed.composition}, experts: {', '.join(composed.names) or 'none'}) at {where}"
          + (" (API key required)" if api_key else ""), file=sys.stderr)
    try:
        uvicorn.Server(uvicorn.Config(app, log_level=args.log_level)).run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn shut down gracefully, then passed Ctrl-C on
        pass
    finally:
        engine.close()
        sock.close()
    return 0


__all__ = ["APIError", "Engine", "Job", "Settings", "build_app", "listening_socket", "main", "running_server"]
