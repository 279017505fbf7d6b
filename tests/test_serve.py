"""compose.serve: the OpenAI-compatible server, driven by the official ``openai`` client and by lm-eval's API models.

The server runs in this process (uvicorn on a thread, a free port) over the tiny exports of ``test_lm_eval``: a
BPE tokenizer with a chat template, a Llama background of 64 positions and two LoRA experts with interval specs.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
pytest.importorskip("lm_eval")

import requests  # noqa: E402
import yaml  # noqa: E402
from lm_eval import simple_evaluate  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from compose import ComposedLM, export_composition  # noqa: E402
from compose.frontends.serve import Engine, build_app, listening_socket, main, running_server  # noqa: E402
from compose.model_card import write_model_card  # noqa: E402
from tests.test_lm_eval import SPECS, bpe_tokenizer, tiny_peft, write_tasks  # noqa: E402

NAME = "tiny-composed"
KEY = "sk-test-key"
CONTEXT = 64  # the tiny background's max_position_embeddings


@dataclass
class World:
    tok: object
    experts: Path
    background: Path
    tasks: Path
    composed: ComposedLM  # in-process reference
    engine: Engine
    url: str


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    tok = bpe_tokenizer()
    peft_model = tiny_peft(len(tok))
    export_composition(root / "experts", tokenizer=tok, peft_model=peft_model, specs=SPECS)
    export_composition(root / "background", tokenizer=tok, background=copy.deepcopy(peft_model).unload())
    write_tasks(root / "tasks")
    engine = Engine(ComposedLM.from_manifest(root / "experts"), max_batch_size=8, batch_wait=0.05)
    with running_server(build_app(engine, model_name=NAME)) as url:
        yield World(tok, root / "experts", root / "background", root / "tasks",
                    ComposedLM.from_manifest(root / "experts"), engine, url)
    engine.close()


def client(world: World, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{world.url}/v1", api_key=key, max_retries=0, timeout=60)


def reference(world: World, prompt_ids: list[int], n: int, composed: ComposedLM | None = None) -> str:
    """The in-process greedy continuation's text (EOS ends it, special tokens skipped)."""
    composed = composed or world.composed
    ids = torch.tensor([prompt_ids])
    out = composed.generate(ids, max_new_tokens=n)[0, ids.shape[1]:].tolist()
    if world.tok.eos_token_id in out:
        out = out[: out.index(world.tok.eos_token_id)]
    return world.tok.decode(out, skip_special_tokens=True)


PROMPTS = ["Q: is the cat", "the dog ran", "[the] cat", "Q: what is two and three?\nA:", "the mat", "A: five"]


# ---------------------------------------------------------------------------------------------- the API


def test_models_and_greedy_completions_equal_the_in_process_model(world):
    api = client(world)
    [card] = api.models.list().data
    assert card.id == NAME and api.models.retrieve(NAME).id == NAME
    for prompt in PROMPTS[:3]:
        out = api.completions.create(model=NAME, prompt=prompt, max_tokens=10, temperature=0)
        assert out.choices[0].text == reference(world, world.tok.encode(prompt), 10)
        assert out.usage.prompt_tokens == len(world.tok.encode(prompt))
    # token ids as the prompt, several prompts in one request
    ids = [world.tok.encode(p) for p in PROMPTS[:2]]
    out = api.completions.create(model=NAME, prompt=ids, max_tokens=6, temperature=0)
    assert [c.text for c in sorted(out.choices, key=lambda c: c.index)] == [reference(world, i, 6) for i in ids]


def test_chat_uses_the_chat_template(world):
    api = client(world)
    messages = [{"role": "user", "content": "is the cat on the mat?"}]
    out = api.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0)
    text = world.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "user: is the cat on the mat?\nassistant:"
    assert out.choices[0].message.content == reference(world, world.tok.encode(text), 12)
    assert out.choices[0].message.role == "assistant" and out.choices[0].finish_reason in ("stop", "length")


def test_concurrent_requests_are_batched_and_answered_as_alone(world):
    api = client(world)
    before = dict(world.engine.stats)
    answers: dict[int, str] = {}

    def ask(i: int) -> None:
        out = api.completions.create(model=NAME, prompt=PROMPTS[i], max_tokens=4 + 2 * i, temperature=0)
        answers[i] = out.choices[0].text

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert answers == {i: reference(world, world.tok.encode(p), 4 + 2 * i) for i, p in enumerate(PROMPTS)}
    assert world.engine.stats["largest_batch"] > 1
    assert world.engine.stats["batches"] - before["batches"] < len(PROMPTS)


def test_streaming_gives_the_same_text_piece_by_piece(world):
    api = client(world)
    for prompt, stop in (("Q: is the cat", None), ("the dog ran", ["a", "J1"])):
        whole = api.completions.create(model=NAME, prompt=prompt, max_tokens=16, temperature=0, stop=stop)
        chunks = list(api.completions.create(model=NAME, prompt=prompt, max_tokens=16, temperature=0, stop=stop,
                                             stream=True, stream_options={"include_usage": True}))
        texts = [c.choices[0].text for c in chunks if c.choices]
        assert "".join(texts) == whole.choices[0].text
        assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finish == [whole.choices[0].finish_reason]
    assert sum(1 for t in texts if t) > 1  # more than one piece
    messages = [{"role": "user", "content": "did the dog run?"}]
    whole = api.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0)
    chunks = list(api.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0,
                                              stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content


def test_stop_strings_cut_the_text_and_stop_each_row(world):
    api = client(world)
    prompt = "Q: is the cat"
    free = reference(world, world.tok.encode(prompt), 20)
    stop = free[5:7]  # a stop string that occurs in the free text
    cut = free[: free.index(stop)]
    out = api.completions.create(model=NAME, prompt=prompt, max_tokens=20, temperature=0, stop=[stop, "zzz"])
    assert out.choices[0].text == cut and out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens < 20
    streamed = "".join(c.choices[0].text for c in api.completions.create(
        model=NAME, prompt=prompt, max_tokens=20, temperature=0, stop=stop, stream=True) if c.choices)
    assert streamed == cut  # no piece of the stop string leaked before it was recognised


def test_echo_logprobs_are_the_composed_scores(world):
    api = client(world)
    ids = world.tok.encode("Q: is the cat on the mat?")
    out = api.completions.create(model=NAME, prompt=ids, max_tokens=1, temperature=0, echo=True, logprobs=2)
    lp = out.choices[0].logprobs
    scores = world.composed.score(torch.tensor([ids]))[0]
    expected = [float(scores[i, ids[i + 1]]) for i in range(len(ids) - 1)]
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(ids) + 1
    assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1:len(ids)], expected, strict=True)) < 1e-4
    # the generated token is the greedy one, and its log-prob the top of its position
    greedy = int(scores[-1].argmax())
    assert lp.tokens[-1] == world.tok.decode([greedy]) and abs(lp.token_logprobs[-1] - float(scores[-1].max())) < 1e-4
    assert all(len(top) >= 2 for top in lp.top_logprobs[1:])
    # max_tokens=0 with echo: the prompt alone
    only = api.completions.create(model=NAME, prompt=ids, max_tokens=0, temperature=0, echo=True, logprobs=0)
    assert len(only.choices[0].logprobs.token_logprobs) == len(ids)


def test_composition_extension_field(world):
    api = client(world)
    ids = world.tok.encode("[the] cat")
    weighted = ComposedLM.from_manifest(world.experts)
    weighted.weights = [0.0, 1.0]
    gated = ComposedLM.from_manifest(world.experts, composition="gated")
    for extra, model in (({"weights": {"a": 0.0}}, weighted), ({"mode": "gated"}, gated)):
        out = api.completions.create(model=NAME, prompt=ids, max_tokens=12, temperature=0,
                                     extra_body={"composition": extra})
        assert out.choices[0].text == reference(world, ids, 12, model)
    assert reference(world, ids, 12, weighted) != reference(world, ids, 12) != reference(world, ids, 12, gated)
    for bad, message in (({"weights": {"calc": 1.0}}, "no expert 'calc'"), ({"mode": "hard"}, "mode")):
        with pytest.raises(openai.BadRequestError, match=message):
            api.completions.create(model=NAME, prompt=ids, max_tokens=2, extra_body={"composition": bad})
    assert world.engine.composed.weights == [1.0, 1.0]  # a request's options do not outlive it


def test_sampling_with_a_seed_reproduces(world):
    api = client(world)
    kw = dict(model=NAME, prompt="the cat", max_tokens=12, temperature=1.5, top_p=0.95, seed=7)
    first = api.completions.create(**kw).choices[0].text
    assert api.completions.create(**kw).choices[0].text == first
    others = {api.completions.create(**{**kw, "seed": s}).choices[0].text for s in range(4)}
    assert len(others) > 1


def test_a_client_that_leaves_frees_its_place(world, monkeypatch):
    engine = world.engine
    generate = engine.composed.generate

    def slow_generate(*args, stopping_criteria=None, **kwargs):  # ~20 ms a step: the client leaves mid-stream
        def criteria(sequences, scores):
            time.sleep(0.02)
            return stopping_criteria(sequences, scores)

        return generate(*args, stopping_criteria=criteria, **kwargs)

    monkeypatch.setattr(engine.composed, "generate", slow_generate)
    before = dict(engine.stats)
    body = json.dumps({"model": NAME, "prompt": "the", "max_tokens": 60, "temperature": 0, "stream": True,
                       "ignore_eos": True})
    host, port = world.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
        received = b""
        while received.count(b"data: ") < 3:
            received += sock.recv(4096)
    deadline = time.monotonic() + 10
    while engine.stats["cancelled"] == before["cancelled"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.stats["cancelled"] == before["cancelled"] + 1
    while engine.stats["batches"] == before["batches"] or engine.busy():
        time.sleep(0.02)
    assert engine.stats["steps"] - before["steps"] < 30  # it stopped decoding well before its 60 tokens
    monkeypatch.undo()
    out = client(world).completions.create(model=NAME, prompt="the", max_tokens=3, temperature=0)
    assert out.choices[0].text == reference(world, world.tok.encode("the"), 3)


# ---------------------------------------------------------------------------------------------- bad input


def error_of(response: requests.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"])
    assert "\n" not in body["error"]["message"]
    return body["error"]


def test_bad_requests_are_openai_errors_and_the_server_keeps_serving(world):
    url = f"{world.url}/v1/completions"
    ok = {"model": NAME, "prompt": "the cat", "max_tokens": 2, "temperature": 0}
    cases = [
        (requests.post(url, data="{not json", headers={"Content-Type": "application/json"}), 400, "malformed JSON"),
        (requests.post(url, json={**ok, "model": "gpt-9"}), 404, "gpt-9"),
        (requests.post(url, json={**ok, "prompt": "the cat " * 40}), 400, "maximum context length is 64"),
        (requests.post(url, json={**ok, "max_tokens": CONTEXT}), 400, "maximum context length"),
        (requests.post(url, json={**ok, "temperature": 5}), 400, "temperature"),
        (requests.post(url, json={**ok, "prompt": []}), 400, "empty"),
        (requests.post(url, json={**ok, "prompt": [[]]}), 400, "empty"),
        (requests.post(url, json={**ok, "prompt": [1, 2, 10_000]}), 400, "outside the vocabulary"),
        (requests.post(url, json={k: v for k, v in ok.items() if k != "prompt"}), 400, "prompt"),
        (requests.post(url, json={**ok, "logit_bias": {"5": 3}}), 400, "logit_bias"),
        (requests.post(f"{world.url}/v1/chat/completions", json={"model": NAME, "messages": []}), 400, "messages"),
        (requests.get(f"{world.url}/v1/nothing"), 404, "/v1/nothing"),
    ]
    for response, status, message in cases:
        assert response.status_code == status, response.text
        assert message in error_of(response)["message"], response.text
    assert error_of(cases[2][0])["code"] == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        client(world).completions.create(model="gpt-9", prompt="x", max_tokens=1)
    assert requests.post(url, json=ok).json()["choices"][0]["text"] == reference(world, world.tok.encode("the cat"), 2)


def test_a_failure_inside_the_model_is_a_500_and_the_next_request_works(world, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("out of\nmemory")

    monkeypatch.setattr(world.engine.composed, "generate", broken)
    response = requests.post(f"{world.url}/v1/completions", json={"model": NAME, "prompt": "the", "max_tokens": 2})
    assert response.status_code == 500 and "RuntimeError: out of memory" in error_of(response)["message"]
    streamed = requests.post(f"{world.url}/v1/completions", json={"model": NAME, "prompt": "the", "max_tokens": 2,
                                                                   "stream": True})
    assert '"error"' in streamed.text and streamed.text.rstrip().endswith("data: [DONE]")
    monkeypatch.undo()
    assert requests.post(f"{world.url}/v1/completions",
                         json={"model": NAME, "prompt": "the", "max_tokens": 2}).status_code == 200


def test_api_key(world):
    engine = Engine(ComposedLM.from_manifest(world.background))
    with running_server(build_app(engine, model_name=NAME, api_key=KEY)) as url:
        for key in ("wrong", "sk-test"):
            with pytest.raises(openai.AuthenticationError):
                openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0).models.list()
        assert requests.get(f"{url}/v1/models").status_code == 401
        assert error_of(requests.post(f"{url}/v1/completions", json={"prompt": "x"}))["code"] == "invalid_api_key"
        api = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        assert api.completions.create(model=NAME, prompt="the", max_tokens=2, temperature=0).choices[0].text
        assert requests.get(f"{url}/health").json() == {"status": "ok"}  # open, for probes
    engine.close()


def test_startup_errors_are_one_line_and_exit_2(world, tmp_path, capsys, monkeypatch):
    taken = listening_socket("127.0.0.1", 0)
    taken.listen()
    port = taken.getsockname()[1]
    assert main([str(world.background), "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"127.0.0.1:{port}" in err[0] and "in use" in err[0].lower()
    taken.close()
    # an export whose weights do not match their checksum
    broken = tmp_path / "broken"
    export_composition(broken, tokenizer=world.tok, background=ComposedLM.from_manifest(world.background).background)
    weights = next((broken / "background").glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:-8])
    capsys.readouterr()
    assert main([str(broken), "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "compose.serve: error:" in err[0] and "model.safetensors: sha256 mismatch" in err[0]
    assert main([str(world.experts), "--port", "0", "--weight", "calc=2"]) == 2
    assert "no expert 'calc'" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- lm-eval


def evaluate(world: World, model: str, model_args: str, tasks: list[str], **kw) -> dict:
    return simple_evaluate(model=model, model_args=model_args, tasks=tasks, log_samples=True, bootstrap_iters=0,
                           task_manager=TaskManager(include_path=str(world.tasks), include_defaults=False), **kw)


def responses(results: dict, task: str) -> list:
    return [s["resps"] for s in results["samples"][task]]


def assert_same(ours: dict, theirs: dict, tasks: list[str]) -> None:
    worst = 0.0
    for task in tasks:
        for a, b in zip(responses(ours, task), responses(theirs, task), strict=True):
            for ra, rb in zip(a, b, strict=True):
                ra, rb = ra[0] if isinstance(ra[0], (tuple, list)) else ra, rb[0] if isinstance(rb[0], (tuple, list)) else rb
                if isinstance(ra[0], str):
                    assert ra == rb, task
                else:
                    worst = max(worst, abs(float(ra[0]) - float(rb[0])))
                    assert len(ra) == 1 or bool(ra[1]) == bool(rb[1]), task
        for key, value in ours["results"][task].items():
            if isinstance(value, float) and "stderr" not in key:
                assert value == pytest.approx(theirs["results"][task][key], rel=1e-4, abs=1e-5), (task, key)
    assert worst < 1e-4, worst


def test_lm_eval_local_completions_equals_the_composed_model(world):
    tasks = ["tiny_mc", "tiny_ll", "tiny_gen", "tiny_roll"]
    # The API models keep one token of max_length for the generated one and score windows of max_length - 1
    # tokens: max_length = CONTEXT there matches the in-process model's windows at CONTEXT - 2.
    ours = evaluate(world, "composed", f"manifest={world.experts},max_length={CONTEXT - 2}", tasks, batch_size=3)
    api_args = (f"model={NAME},base_url={world.url}/v1/completions,tokenizer={world.experts / 'tokenizer'},"
                f"tokenizer_backend=huggingface,add_bos_token=True,max_length={CONTEXT},num_concurrent=3")
    theirs = evaluate(world, "local-completions", api_args, tasks, batch_size=2)
    assert_same(ours, theirs, tasks)


def test_lm_eval_local_chat_completions_equals_the_composed_model(world):
    ours = evaluate(world, "composed", f"manifest={world.experts}", ["tiny_gen"], apply_chat_template=True)
    api_args = f"model={NAME},base_url={world.url}/v1/chat/completions,max_length={CONTEXT}"
    theirs = evaluate(world, "local-chat-completions", api_args, ["tiny_gen"], apply_chat_template=True)
    assert ours["samples"]["tiny_gen"][0]["arguments"][0][0].startswith("user: Q:")
    assert_same(ours, theirs, ["tiny_gen"])


# ---------------------------------------------------------------------------------------------- model card


def test_model_card(world, tmp_path):
    export = tmp_path / "export"
    export_composition(export, tokenizer=world.tok, peft_model=tiny_peft(len(world.tok)), specs=SPECS,
                       weights={"b": 0.5})
    path = write_model_card(export, metrics={"composition.exact_match": 0.93, "experts.a.exact_match": 0.98})
    text = path.read_text()
    assert path == export / "README.md" and text.startswith("---\n")
    front = yaml.safe_load(text.split("---\n")[1])
    assert front["library_name"] == "peft" and "composable-experts" in front["tags"]
    assert "base_model" not in front  # a background saved in the export names no hub model
    for needle in ("| a | lora | 1 |", "| b | lora | 0.5 |", "`[a-h]`", "0.93", "ComposedLM.from_manifest",
                   "python -m compose.serve"):
        assert needle in text, needle
    # the card is not part of what the checksums cover: the export still loads
    assert ComposedLM.from_manifest(export).names == ["a", "b"]
    with pytest.raises(FileNotFoundError, match="composition.yaml"):
        write_model_card(tmp_path)


def test_module_command_serves_until_interrupted(world):
    probe = listening_socket("127.0.0.1", 0)
    port = probe.getsockname()[1]
    probe.close()
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen([sys.executable, "-m", "compose.serve", str(world.experts), "--port", str(port),
                             "--log-level", "warning"], cwd=root, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "COMPOSE_API_KEY": KEY})
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                requests.get(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except requests.ConnectionError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
                time.sleep(0.2)
        api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)
        out = api.completions.create(model="experts", prompt="the cat", max_tokens=4, temperature=0)
        assert out.choices[0].text == reference(world, world.tok.encode("the cat"), 4)
        assert requests.get(f"http://127.0.0.1:{port}/v1/models").status_code == 401  # the key from the environment
    finally:
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=60)
    assert code == 0
    assert "compose.serve: experts (soft, experts: a, b) at http://127.0.0.1:" in proc.stderr.read()
