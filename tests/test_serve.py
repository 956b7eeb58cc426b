"""serve/: a live server on localhost (uvicorn in a thread, or `moeprefetch serve` in a process) driven by the
official `openai` client: answers equal `engine.generate`, streaming equals non-streaming, concurrent clients get
their single-request answers, bad requests get OpenAI-style errors, disconnects free rows, a full queue answers 429,
an engine error fails one request only, a bounded load test loses nothing, SIGTERM drains. Issue 40: body limits,
tokenisation off the event loop, the drain's cut answered, a second signal exits cleanly, JSON 404/405, deep JSON and
lone surrogates, the chat fallback template, parameters refused by name, API keys, Host and Content-Type checks,
Retry-After, 503 while draining, aborted and stalled uploads, queued clients gone, max_tokens clamped, 64-bit signed seeds;
logprobs (both shapes, streamed and not), logit_bias and the penalties as `engine.generate` gives them."""

from __future__ import annotations

import gc
import json
import logging
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from moeprefetch import MoEPrefetchEngine  # noqa: E402
from moeprefetch.serve.guards import DEFAULT_BODY_TIMEOUT  # noqa: E402

CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
ENGINE = dict(progress=False, max_seq_len=256, expert_cache_slots=6)
PROMPTS = ["the quick brown fox", "In the beginning", "def main(): return", "Linux kernel memory",
           "the lazy dog jumps", "documentation describes", "over the", "word. def"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def model_dir(checkpoint_factory, tiny_tokenizer_dir, tmp_path_factory) -> Path:
    """The tiny V3 checkpoint with a tokenizer that has a chat template."""
    path = tmp_path_factory.mktemp("served") / "tiny"
    shutil.copytree(checkpoint_factory("v3", tokenizer_from=tiny_tokenizer_dir), path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = CHAT_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def plain_model_dir(checkpoint_factory, tiny_tokenizer_dir) -> Path:
    """The same checkpoint and tokenizer without a chat template (as the shipped reference model)."""
    path = checkpoint_factory("v3", tokenizer_from=tiny_tokenizer_dir)
    assert "chat_template" not in json.loads((path / "tokenizer_config.json").read_text())
    return path


class LiveServer:
    def __init__(self, path: Path, max_batch_size: int = 4, max_queue: int = 32, name: str = "tiny",
                 drain_seconds: float = 2.0, engine_options: dict | None = None, **options):
        from moeprefetch.serve.app import build_app
        from moeprefetch.serve.lifecycle import DrainingServer, server_config

        self.engine = MoEPrefetchEngine.from_pretrained(path, max_batch_size=max_batch_size,
                                                        **{**ENGINE, **(engine_options or {})})
        self.app = build_app(self.engine, name, max_queue=max_queue, drain_seconds=drain_seconds,
                             default_max_tokens=16, **options)
        self.port = _free_port()
        config = server_config(self.app, "127.0.0.1", self.port,
                               header_timeout=options.get("body_timeout", DEFAULT_BODY_TIMEOUT))
        self.server = DrainingServer(config, self.app.state.server)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=60)

    @property
    def scheduler(self):
        return self.app.state.server.scheduler

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.engine.close()


@pytest.fixture(scope="module")
def live(model_dir):
    server = LiveServer(model_dir)
    yield server
    server.close()


@pytest.fixture(scope="module")
def reference(model_dir):
    """The same model in its own engine: the answers a request gets alone."""
    return MoEPrefetchEngine.from_pretrained(model_dir, max_batch_size=1, **ENGINE)


def _alone(reference, prompt, max_tokens, temperature=0.0, seed=None, top_p=1.0):
    result = reference.generate([prompt], max_new_tokens=max_tokens, temperature=temperature, seed=seed, top_p=top_p)
    return result.texts[0], len(result.sequences[0])


def test_completions_equal_engine_generate_and_count_usage(live, reference):
    for prompt in PROMPTS[:3]:
        answer = live.client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
        text, generated = _alone(reference, prompt, 12)
        assert answer.choices[0].text == text
        assert answer.choices[0].finish_reason in ("length", "stop")
        prompt_ids = reference.tokenizer(prompt)["input_ids"]
        assert answer.usage.prompt_tokens == len(prompt_ids)
        assert answer.usage.completion_tokens == generated
        assert answer.usage.total_tokens == len(prompt_ids) + generated
    ids = live.client.completions.create(model="tiny", prompt=[3, 4, 5, 6], max_tokens=6, temperature=0)
    assert ids.choices[0].text == _alone(reference, [3, 4, 5, 6], 6)[0]


def test_streaming_equals_non_streaming_for_completions_and_chat(live):
    for seed, temperature in ((None, 0.0), (7, 0.9)):
        full = live.client.completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=14, temperature=temperature,
                                              seed=seed)
        pieces = [c.choices[0].text for c in live.client.completions.create(
            model="tiny", prompt=PROMPTS[3], max_tokens=14, temperature=temperature, seed=seed, stream=True)]
        assert "".join(pieces) == full.choices[0].text
    messages = [{"role": "user", "content": "tell me about the fox"}]
    chat = live.client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.object == "chat.completion"
    streamed = live.client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                                   stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == chat.choices[0].message.content


def test_chat_applies_the_template(live, reference):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the quick"}]
    chat = live.client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    templated = reference.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    templated = templated["input_ids"] if hasattr(templated, "keys") else templated
    assert chat.usage.prompt_tokens == len(templated)
    assert chat.choices[0].message.content == _alone(reference, list(templated), 8)[0]


def test_concurrent_clients_each_get_their_single_request_answer(live, reference):
    """Eight clients at once through four batch rows: requests join and leave the running batch; greedy and seeded
    sampling answers are those each request gets alone."""
    jobs = [(prompt, 0.0 if i % 2 == 0 else 0.8, None if i % 2 == 0 else 100 + i) for i, prompt in enumerate(PROMPTS)]

    def ask(job):
        prompt, temperature, seed = job
        return live.client.completions.create(model="tiny", prompt=prompt, max_tokens=10 + len(prompt) % 5,
                                              temperature=temperature, seed=seed).choices[0].text

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, jobs))
    for (prompt, temperature, seed), answer in zip(jobs, answers):
        assert answer == _alone(reference, prompt, 10 + len(prompt) % 5, temperature, seed)[0]


def test_bad_requests_get_openai_style_errors(live):
    cases = [
        (dict(model="tiny", prompt="x", temperature=-1), 400, "temperature"),
        (dict(model="tiny", prompt="x", n=2), 400, "n"),
        (dict(model="tiny", prompt=""), 400, "prompt"),
        (dict(model="tiny", prompt="x", max_tokens=0), 400, "max_tokens"),
        (dict(model="tiny", prompt="x", top_p=1.5), 400, "top_p"),
        (dict(model="tiny", prompt="x", top_p=0), 400, "top_p"),
        (dict(model="tiny", prompt="x", stop=["a"] * 9), 400, "stop"),
        (dict(model="tiny", prompt=[3, 99999]), 400, None),
        (dict(model="other", prompt="x"), 404, "model"),
        (dict(model=5, prompt="x"), 400, "model"),
        (dict(model="tiny", prompt="x", ignore_eos="yes"), 400, "ignore_eos"),
    ]
    for body, status, param in cases:
        response = httpx.post(live.url + "/v1/completions", json=body, timeout=30)
        assert response.status_code == status, (body, response.text)
        error = response.json()["error"]
        assert error["message"] and error["type"] and (param is None or error["param"] == param)
        if param == "top_p":  # one range, said the same way for every value outside it
            assert "top_p must lie in (0, 1]" in error["message"], error
    response = httpx.post(live.url + "/v1/completions", content=b"{not json", timeout=30,
                          headers={"Content-Type": "application/json"})
    assert response.status_code == 400 and "JSON" in response.json()["error"]["message"]
    response = httpx.post(live.url + "/v1/chat/completions", json={"model": "tiny", "messages": []}, timeout=30)
    assert response.status_code == 400
    with pytest.raises(openai.NotFoundError):
        live.client.completions.create(model="missing", prompt="x", max_tokens=2)
    assert httpx.get(live.url + "/health", timeout=30).json()["status"] == "ok"


def test_models_health_and_metrics(live):
    models = live.client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    live.client.completions.create(model="tiny", prompt="the quick", max_tokens=4, temperature=0)
    metrics = httpx.get(live.url + "/metrics", timeout=30).text
    for name in ("moeprefetch_requests_total", "moeprefetch_queue_depth", "moeprefetch_completion_tokens_total",
                 "moeprefetch_expert_hit_rate", "moeprefetch_prefetch_useful_total", "moeprefetch_prefetch_wasted_total",
                 "moeprefetch_link_bytes_total"):
        assert name in metrics, name
    completed = [line for line in metrics.splitlines() if 'outcome="ok"' in line or 'outcome="stopped"' in line]
    assert sum(float(line.split()[-1]) for line in completed) >= 1
    # the scheduler's time in prefills and decode steps, both spent by now (one prompt, its new tokens)
    value = {line.split("{")[0]: float(line.split()[-1]) for line in metrics.splitlines() if "{" in line}
    assert value["moeprefetch_prefill_seconds_total"] > 0 and value["moeprefetch_decode_seconds_total"] > 0
    assert value["moeprefetch_decode_steps_total"] >= 3
    # refusals before the scheduler, by status: a bad body (400), an unknown model (404), a wrong route (404)
    def refused(status: int) -> float:
        text = httpx.get(live.url + "/metrics", timeout=30).text
        return sum(float(line.split()[-1]) for line in text.splitlines()
                   if 'outcome="refused"' in line and f'status="{status}"' in line)

    before = refused(400), refused(404)
    httpx.post(live.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": -1}, timeout=30)
    httpx.post(live.url + "/v1/completions", json={"model": "other", "prompt": "x"}, timeout=30)
    httpx.get(live.url + "/v1/nothing", timeout=30)
    assert (refused(400), refused(404)) == (before[0] + 1, before[1] + 2)


def test_ignore_eos_generates_max_tokens_and_streams_one_chunk_per_token(live):
    body = {"model": "tiny", "prompt": [3, 4, 5], "max_tokens": 9, "temperature": 0, "ignore_eos": True}
    assert httpx.post(live.url + "/v1/completions", json=body, timeout=30).json()["usage"]["completion_tokens"] == 9
    with httpx.stream("POST", live.url + "/v1/completions", json={**body, "stream": True}, timeout=30) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    assert len(chunks) == 10 and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "usage" not in chunks[-1]  # only when asked for, as OpenAI's API does
    with httpx.stream("POST", live.url + "/v1/completions", timeout=30,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 9
    assert all(chunk["usage"] is None for chunk in chunks[:-1])  # the field in every chunk, null before the last
    refused = httpx.post(live.url + "/v1/completions", json={**body, "stream_options": {"include_usage": True}},
                         timeout=30)
    assert _error_of(refused, 400, "stream_options")  # the options of a stream, not of a single answer
    # a stream that fails before its first token gets the HTTP error, not a 200 with an error event
    response = httpx.post(live.url + "/v1/completions", timeout=30,
                          json={"model": "tiny", "prompt": [3, 10**6], "max_tokens": 3, "stream": True})
    assert _error_of(response, 400, "prompt")["message"]  # the engine's check names the field it refused


def test_a_client_that_disconnects_frees_its_row(live, monkeypatch):
    # steps of at least 10 ms: the 200 tokens outlast the server's notice of the disconnect on any machine (on a busy
    # CI runner the tiny model once finished them first, and nothing was left to cancel)
    batch = live.scheduler.batch
    step = batch.step
    monkeypatch.setattr(batch, "step", lambda: (time.sleep(0.01), step())[1])
    with httpx.stream("POST", live.url + "/v1/completions", timeout=30,
                      json={"model": "tiny", "prompt": "the quick", "max_tokens": 200, "temperature": 0,
                            "ignore_eos": True, "stream": True}) as response:
        events = (line for line in response.iter_lines() if line)
        # the first token comes from the prefill; the second from a (slowed) step: then the client leaves
        assert next(events).startswith("data: ") and next(events).startswith("data: ")
    deadline = time.monotonic() + 20
    while live.scheduler.snapshot()["active"] and time.monotonic() < deadline:
        time.sleep(0.05)
    state = live.scheduler.snapshot()
    assert state["active"] == 0 and state["requests"]["cancelled"] >= 1
    # every step's duration kept (fewer than RECENT_STEPS so far), the slowed ones at least their 10 ms
    durations = state["recent_step_seconds"]
    assert len(durations) == state["decode_steps"] and durations[-1] >= 0.01
    assert live.client.completions.create(model="tiny", prompt="x", max_tokens=3, temperature=0).choices


def test_a_non_streaming_client_that_disconnects_frees_its_row(live):
    before = live.scheduler.snapshot()["requests"]["cancelled"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(live.url + "/v1/completions", timeout=0.5,
                   json={"model": "tiny", "prompt": [3, 4, 5], "max_tokens": 240, "temperature": 0,
                         "ignore_eos": True})
    deadline = time.monotonic() + 20
    while live.scheduler.snapshot()["active"] and time.monotonic() < deadline:
        time.sleep(0.05)
    state = live.scheduler.snapshot()
    assert state["active"] == 0 and state["requests"]["cancelled"] > before
    assert state["completion_tokens"] > 0


def test_unseeded_sampling_differs_between_requests(live):
    answers = {live.client.completions.create(model="tiny", prompt="the quick", max_tokens=16,
                                              temperature=1.5).choices[0].text for _ in range(4)}
    assert len(answers) > 1


def test_a_failed_decode_step_fails_its_requests_and_the_server_carries_on(live, monkeypatch):
    batch = live.scheduler.batch
    step = batch.step
    failures = {"left": 1}

    def failing():
        if failures["left"]:
            failures["left"] -= 1
            raise RuntimeError("injected step failure")
        return step()

    monkeypatch.setattr(batch, "step", failing)
    response = httpx.post(live.url + "/v1/completions", timeout=60,
                          json={"model": "tiny", "prompt": [3, 4, 5], "max_tokens": 6, "temperature": 0})
    assert response.status_code == 500 and "injected step failure" in response.json()["error"]["message"]
    assert live.client.completions.create(model="tiny", prompt=[3, 4], max_tokens=4, temperature=0).choices


def test_a_failed_step_beside_a_prompt_half_prefilled_begins_that_prompt_again(model_dir, reference, monkeypatch):
    """A decode step that fails while a long prompt is prefilled a window at a time between the steps fails the
    rows it computed; the prompt's prefill, dropped with the table, begins again and its request gets the answer it
    gets alone (the scheduler thread used to stop on the dropped admission)."""
    live = LiveServer(model_dir, engine_options=dict(prefill_chunk=16), prefill_tokens_per_step=40)
    try:
        batch = live.scheduler.batch
        step, failed = batch.step, []

        def failing():
            if batch.admissions and not failed:
                failed.append(dict(batch.admissions))
                raise RuntimeError("injected step failure")
            return step()

        monkeypatch.setattr(batch, "step", failing)
        streaming, _ = _timed_stream(live, 100)
        long = list(range(3, 103))
        answer = httpx.post(live.url + "/v1/completions", timeout=60,
                            json={"model": "tiny", "prompt": long, "max_tokens": 4, "temperature": 0})
        streaming.join(timeout=60)
        assert failed and answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"] == _alone(reference, long, 4)[0]
        assert live.scheduler._thread.is_alive() and not batch.admissions
    finally:
        live.close()


def test_stop_strings_end_the_text_before_them(live, reference):
    # a prompt whose answer alone is long enough to hold a stop string (a random model may end one at once)
    prompt, full = next((p, text) for p in PROMPTS if len(text := _alone(reference, p, 16)[0]) > 6)
    stop = full[3:5]
    answer = live.client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0, stop=stop)
    assert answer.choices[0].text == full[: full.find(stop)] and answer.choices[0].finish_reason == "stop"
    streamed = live.client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0,
                                              stop=[stop], stream=True)
    assert "".join(c.choices[0].text for c in streamed) == full[: full.find(stop)]


def test_a_stop_string_cuts_the_log_probabilities_of_the_tokens_it_spans(live, reference):
    """The tokens whose text begins inside a stop string leave the logprobs with the text they spell: the answer's
    tokens are the unstopped answer's tokens that begin before the cut, with the same values, streamed or not."""
    body = {"model": "tiny", "max_tokens": 16, "temperature": 0, "logprobs": 1}
    for prompt in PROMPTS:
        full = httpx.post(live.url + "/v1/completions", json={**body, "prompt": prompt}, timeout=60).json()
        text, logprobs = full["choices"][0]["text"], full["choices"][0]["logprobs"]
        # a stop string that begins where the third token or a later one does, found nowhere earlier
        starts = [o for o in logprobs["text_offset"][2:] if 0 < o < len(text) - 1 and text.find(text[o:o + 2]) == o]
        if starts:
            break
    else:
        pytest.skip("no answer holds a usable stop string")
    cut = starts[0]
    kept = [i for i, o in enumerate(logprobs["text_offset"]) if o < cut]
    assert 0 < len(kept) < len(logprobs["tokens"])
    stopped = httpx.post(live.url + "/v1/completions", json={**body, "prompt": prompt, "stop": text[cut:cut + 2]},
                         timeout=60).json()["choices"][0]
    assert stopped["text"] == text[:cut] and stopped["finish_reason"] == "stop"
    for key in ("tokens", "token_logprobs", "text_offset"):
        assert stopped["logprobs"][key] == [logprobs[key][i] for i in kept], key
    chunks = list(live.client.completions.create(stream=True, prompt=prompt, stop=text[cut:cut + 2], **body))
    assert [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens] == \
        stopped["logprobs"]["tokens"]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text[:cut]


def test_an_engine_error_fails_that_request_only(live, monkeypatch):
    """An error in a prefill window fails its request alone (500), before its first token too when streamed. The
    three requests sent together are offered to a joint admission first, which the engine here refuses: they are
    then admitted one by one, each answered for itself."""
    from moeprefetch.errors import RequestError

    batch = live.scheduler.batch
    begin, advance, failing, refused = batch.begin, batch.advance, set(), []

    def refusing(jobs):
        refused.append(len(jobs))
        raise RequestError("not as a group")

    def beginning(prompt, *args, **kwargs):
        row = begin(prompt, *args, **kwargs)
        (failing.add if prompt[:2] == [7, 7] else failing.discard)(row)
        return row

    def advancing(row):
        if row in failing:
            raise RuntimeError("injected failure")
        return advance(row)

    monkeypatch.setattr(batch, "begin", beginning)
    monkeypatch.setattr(batch, "advance", advancing)
    monkeypatch.setattr(batch, "admit_together", refusing)
    monkeypatch.setattr(live.scheduler, "admit_wait", 0.3)  # the three are gathered (and refused together)
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(httpx.post, live.url + "/v1/completions", timeout=60,
                               json={"model": "tiny", "prompt": ids, "max_tokens": 6, "temperature": 0})
                   for ids in ([7, 7, 8], [3, 4, 5], [9, 10])]
        responses = [f.result() for f in futures]
    assert responses[0].status_code == 500 and "injected failure" in responses[0].json()["error"]["message"]
    assert [r.status_code for r in responses[1:]] == [200, 200]
    assert refused and max(refused) >= 2
    # streaming: a failure before the first token is the HTTP status, not a 200 with an error event
    streamed = httpx.post(live.url + "/v1/completions", timeout=60,
                          json={"model": "tiny", "prompt": [7, 7, 9], "max_tokens": 6, "stream": True})
    assert streamed.status_code == 500 and "injected failure" in streamed.json()["error"]["message"]
    assert httpx.get(live.url + "/health", timeout=30).status_code == 200


def test_a_full_queue_answers_429_and_loses_nothing_else(model_dir):
    server = LiveServer(model_dir, max_batch_size=1, max_queue=1, name="small")
    try:
        def ask(i):
            return httpx.post(server.url + "/v1/completions", timeout=60,
                              json={"model": "small", "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 30,
                                    "temperature": 0})

        with ThreadPoolExecutor(6) as pool:
            responses = list(pool.map(ask, range(6)))
        codes = [r.status_code for r in responses]
        assert 429 in codes and set(codes) <= {200, 429}
        rejected = [r for r in responses if r.status_code == 429]
        assert all(r.json()["error"]["type"] == "rate_limit_error" for r in rejected)
        assert all(r.headers["retry-after"] == "1" for r in rejected)
        assert all(r.json()["choices"][0]["text"] is not None for r in responses if r.status_code == 200)
    finally:
        server.close()


def test_requests_on_their_way_into_free_rows_are_not_counted_as_waiting(model_dir):
    """The queue refuses only what would wait beyond the free rows: batch rows + max_queue requests at once are
    all taken on an idle server (the scheduler thread may not have moved any into a row yet)."""
    import asyncio

    from moeprefetch.sampling import SamplingParams
    from moeprefetch.serve.protocol import APIError, Job
    from moeprefetch.serve.scheduler import Handle

    server = LiveServer(model_dir, max_batch_size=4, max_queue=2, name="small")
    loop = asyncio.new_event_loop()

    def handle() -> Handle:
        job = Job(kind="text_completion", prompt_ids=[7, 8, 9], max_tokens=2, sampling=SamplingParams(), stop=[],
                  stream=False)
        return Handle(job=job, loop=loop, events=asyncio.Queue())

    try:
        with server.scheduler._cond:  # the scheduler thread waits: every request stays queued while it is submitted
            for _ in range(4 + 2):
                server.scheduler.submit(handle())
            with pytest.raises(APIError) as refused:
                server.scheduler.submit(handle())
            assert refused.value.status == 429 and refused.value.code == "rate_limit_exceeded"
    finally:
        server.close()
        loop.close()


@pytest.mark.slow  # the fast lane: every one of 64 concurrent requests answered (test_64_concurrent_...)
def test_bounded_load_loses_no_request(live, capsys):
    """48 requests from 8 workers: every one answered in time; the latency percentiles and throughput are printed."""
    started = time.perf_counter()
    latencies, tokens = [], []

    def ask(i):
        t0 = time.perf_counter()
        answer = live.client.completions.create(model="tiny", prompt=PROMPTS[i % len(PROMPTS)], max_tokens=12,
                                                temperature=0)
        latencies.append(time.perf_counter() - t0)
        tokens.append(answer.usage.completion_tokens)
        return answer.choices[0].finish_reason

    with ThreadPoolExecutor(8) as pool:
        reasons = list(pool.map(ask, range(48)))
    elapsed = time.perf_counter() - started
    assert len(reasons) == 48 and all(r in ("length", "stop") for r in reasons)
    assert elapsed < 240
    q = statistics.quantiles(latencies, n=100)
    with capsys.disabled():
        print(f"\nload test (CPU, tiny model, batch 4): 48 requests, p50 {q[49]:.3f} s, p99 {q[98]:.3f} s, "
              f"{sum(tokens) / elapsed:.1f} tokens/s")


def _cli_server(model_dir: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    """`moeprefetch serve` in a process, once its /health answers."""
    port = _free_port()
    command = [sys.executable, "-m", "moeprefetch", "serve", str(model_dir), "--port", str(port), "--cache-slots", "6",
               "--max-batch-size", "2", "--max-seq-len", "256", "--model-name", "tiny", *extra]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        if process.poll() is not None:
            raise AssertionError(process.stderr.read())
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            process.kill()
            raise AssertionError("the server did not come up")
        time.sleep(0.2)


@pytest.mark.slow  # the fast lane drains in-process (test_requests_cut_by_the_drain_...) and signals twice
def test_sigterm_drains_requests_in_flight_then_exits(model_dir):
    process, url = _cli_server(model_dir, "--drain-seconds", "20")
    try:
        result: dict = {}

        def long_request():
            response = httpx.post(url + "/v1/completions", timeout=60,
                                  json={"model": "tiny", "prompt": "the quick", "max_tokens": 120, "temperature": 0})
            result["status"], result["body"] = response.status_code, response.json()

        thread = threading.Thread(target=long_request)
        thread.start()
        time.sleep(0.5)  # the request is in flight
        process.send_signal(signal.SIGTERM)
        thread.join(timeout=60)
        assert result["status"] == 200
        # the request in flight ran to its end: every token, not a cut-short answer
        choice, usage = result["body"]["choices"][0], result["body"]["usage"]
        assert (choice["finish_reason"], usage["completion_tokens"]) in (("length", 120),) or choice[
            "finish_reason"] == "stop"
        assert process.wait(timeout=60) == 0
        # the engine's objects, frozen out of the collector while serving, are given back before the process ends:
        # their finalisers run (frozen, Triton's bindings reported dozens of "leaked" objects at exit)
        assert "leaked" not in process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()


def test_an_engine_thread_that_dies_fails_its_requests_and_refuses_new_ones(model_dir, monkeypatch):
    server = LiveServer(model_dir, max_batch_size=1, name="fragile")
    try:
        scheduler = server.scheduler

        def broken(handle, token):
            raise RuntimeError("injected thread failure")

        monkeypatch.setattr(scheduler, "_token", broken)
        body = {"model": "fragile", "prompt": [3, 4], "max_tokens": 4, "temperature": 0}
        response = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert response.status_code == 500 and "engine thread stopped" in response.json()["error"]["message"]
        again = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert again.status_code == 503
        assert httpx.get(server.url + "/health", timeout=30).status_code == 503
    finally:
        server.close()


# ---- issue 40: limits, errors, shutdown, parameters, access ---------------------------------------------------------
API_KEY = "sekrit-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def guarded(plain_model_dir):
    """A server with an API key, a 64 KiB body limit, a 1 s body timeout and loopback Host names only, over the model
    without a chat template."""
    from moeprefetch.serve.guards import default_allowed_hosts

    server = LiveServer(plain_model_dir, name="guarded", api_key=API_KEY, max_body_bytes=64 * 1024, body_timeout=1.0,
                        allowed_hosts=default_allowed_hosts("127.0.0.1"))
    server.client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    yield server
    server.close()


def _error_of(response, status: int, param: str | None = "any") -> dict:
    """The OpenAI-shaped JSON error of a response with this status (and this param, unless "any")."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json"), response.headers
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"] and error["type"]
    assert error["code"] is None or isinstance(error["code"], str), error  # what OpenAI's clients parse
    assert param == "any" or error["param"] == param, error
    return error


def _wait_for(condition, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


def _slow_steps(monkeypatch, scheduler, seconds: float) -> None:
    """Decode steps of at least `seconds`: requests outlast what the test does meanwhile on any machine."""
    batch = scheduler.batch
    step = batch.step
    monkeypatch.setattr(batch, "step", lambda: (time.sleep(seconds), step())[1])


def _raw_head(path: str, length: int, port: int, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n{extra}\r\n").encode()


def _read_reply(sock: socket.socket) -> bytes:
    """A raw HTTP reply: until its body has all come (by Content-Length) or the server closed the connection."""
    reply = b""
    while True:
        head, sep, body = reply.partition(b"\r\n\r\n")
        lengths = [line.split(b":")[1] for line in head.lower().split(b"\r\n") if line.startswith(b"content-length:")]
        if sep and lengths and len(body) >= int(lengths[0]):
            return reply
        try:
            data = sock.recv(65536)
        except ConnectionResetError:
            return reply
        if not data:
            return reply
        reply += data


def test_a_body_over_the_limit_is_a_413_json_error(guarded):
    big = {"model": "guarded", "prompt": "x" * 70_000}
    error = _error_of(httpx.post(guarded.url + "/v1/completions", json=big, headers=AUTH, timeout=30), 413, None)
    assert "65536 bytes" in error["message"] and "--max-body-bytes" in error["message"]
    # no Content-Length (chunked): refused as the bytes pass the limit
    chunked = b"".join(b"1000\r\n" + b" " * 4096 + b"\r\n" for _ in range(20)) + b"0\r\n\r\n"
    with socket.create_connection(("127.0.0.1", guarded.port), timeout=10) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {API_KEY}\r\n"
                     "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n".encode() + chunked)
        reply = _read_reply(sock)
    assert reply.startswith(b"HTTP/1.1 413") and b'"request_too_large"' in reply
    assert httpx.get(guarded.url + "/health", timeout=30).status_code == 200


def _timed_stream(live, tokens: int) -> tuple[threading.Thread, list[float]]:
    """A stream of `tokens` tokens in a thread, started and active on return; the gaps between its chunks."""
    gaps: list[float] = []

    def stream():
        with httpx.stream("POST", live.url + "/v1/completions", timeout=60,
                          json={"model": "tiny", "prompt": [3, 4, 5], "max_tokens": tokens, "temperature": 0,
                                "ignore_eos": True, "stream": True}) as response:
            last = time.perf_counter()
            for _ in response.iter_lines():
                gaps.append(time.perf_counter() - last)
                last = time.perf_counter()

    streaming = threading.Thread(target=stream)
    streaming.start()
    _wait_for(lambda: live.scheduler.snapshot()["active"] == 1)
    return streaming, gaps


def test_requests_waiting_while_none_decode_are_prefilled_together(model_dir, reference, monkeypatch):
    """With no row decoding, the requests that waited (here behind a one-token request's prefill) are admitted
    together, their prompts sharing prefill windows (`ContinuousBatch.admit_together`), and each gets the answer it
    gets alone."""
    live = LiveServer(model_dir)
    try:
        scheduler, batch = live.scheduler, live.scheduler.batch
        groups: list[int] = []
        advance, together = batch.advance, batch.admit_together

        def advancing(row):  # the first request's prefill waits until three more are queued
            _wait_for(lambda: len(scheduler.queue) == 3)
            return advance(row)

        def recording(jobs):
            groups.append(len(jobs))
            return together(jobs)

        monkeypatch.setattr(batch, "advance", advancing)
        monkeypatch.setattr(batch, "admit_together", recording)
        prompts = [[3, 4, 5], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [20, 21], list(range(30, 47))]
        with ThreadPoolExecutor(4) as pool:
            def ask(prompt, tokens):
                return pool.submit(lambda: httpx.post(live.url + "/v1/completions", timeout=60, json={
                    "model": "tiny", "prompt": prompt, "max_tokens": tokens, "temperature": 0}).json())

            futures = [ask(prompts[0], 1)]
            _wait_for(lambda: scheduler.snapshot()["admitting"] == 1)
            futures += [ask(prompt, 5) for prompt in prompts[1:]]
            answers = [f.result() for f in futures]
        assert groups == [3]
        assert [a["choices"][0]["text"] for a in answers] == [_alone(reference, p, n)[0]
                                                              for p, n in zip(prompts, (1, 5, 5, 5))]
        # an engine error in a joint prefill fails its group alone (500 each), and the server goes on
        monkeypatch.setattr(batch, "admit_together", lambda jobs: (_ for _ in ()).throw(RuntimeError("boom")))
        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(lambda: httpx.post(live.url + "/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": prompts[0], "max_tokens": 1, "temperature": 0}))]
            _wait_for(lambda: scheduler.snapshot()["admitting"] == 1)
            futures += [pool.submit(lambda p=p: httpx.post(live.url + "/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": p, "max_tokens": 5, "temperature": 0})) for p in prompts[1:]]
            failed = [f.result() for f in futures[1:]]
        assert futures[0].result().status_code == 200
        assert [r.status_code for r in failed] == [500] * 3 and all("boom" in r.text for r in failed)
        assert batch.free_rows == [0, 1, 2, 3]
        monkeypatch.setattr(batch, "advance", advance)
        assert live.client.completions.create(model="tiny", prompt="x", max_tokens=3, temperature=0).choices
    finally:
        live.close()


def test_requests_sent_together_are_gathered_and_prefilled_together(model_dir, reference, monkeypatch):
    """An idle server waits --admit-wait-ms for requests sent with the first, and again after each arrival (here
    400 ms, three requests sent 250 ms apart, 500 ms in all): the three are prefilled together and counted so; while
    a stream decodes, two short prompts queued together are admitted together between two of its steps (their
    tokens within --prefill-tokens-per-step), a third that does not fit that budget alone; every answer is the one
    it gets alone."""
    live = LiveServer(model_dir, admit_wait=0.4, prefill_tokens_per_step=24)
    try:
        scheduler, batch = live.scheduler, live.scheduler.batch
        groups: list[int] = []
        together, step = batch.admit_together, batch.step

        def recording(jobs):
            groups.append(len(jobs))
            return together(jobs)

        monkeypatch.setattr(batch, "admit_together", recording)
        prompts = [[3, 4, 5], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [20, 21], list(range(30, 47))]

        def ask(pool, prompt, tokens):
            return pool.submit(lambda: httpx.post(live.url + "/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": prompt, "max_tokens": tokens, "temperature": 0}).json())

        with ThreadPoolExecutor(3) as pool:
            futures = []
            for prompt in prompts[:3]:
                futures.append(ask(pool, prompt, 4))
                time.sleep(0.25)
            answers = [f.result() for f in futures]
        assert groups == [3]
        state = scheduler.snapshot()
        assert (state["joint_admissions"], state["admitted_together"]) == (1, 3)
        assert 'moeprefetch_requests_admitted_together_total{model="tiny"} 3' in \
            httpx.get(live.url + "/metrics", timeout=10).text
        assert [a["choices"][0]["text"] for a in answers] == [_alone(reference, p, 4)[0] for p in prompts[:3]]

        groups.clear()
        waiting = {"for": 0}

        def stepping():  # the stream's next step waits until the three are queued
            deadline = time.monotonic() + 10
            while len(scheduler.queue) < waiting["for"] and time.monotonic() < deadline:
                time.sleep(0.005)
            waiting["for"] = 0
            return step()

        monkeypatch.setattr(batch, "step", stepping)
        streaming, _ = _timed_stream(live, 60)
        waiting["for"] = 3
        with ThreadPoolExecutor(3) as pool:
            futures = []
            for n, prompt in enumerate(prompts[1:], 1):  # queued in this order
                futures.append(ask(pool, prompt, 5))
                if n < 3:  # the third lets the stream's step go on, which takes the three off the queue
                    _wait_for(lambda n=n: len(scheduler.queue) == n)
            answers = [f.result() for f in futures]
        streaming.join(timeout=60)
        assert groups == [2]  # 10 + 2 tokens together; the 17 more would pass the budget of 24
        assert [a["choices"][0]["text"] for a in answers] == [_alone(reference, p, 5)[0] for p in prompts[1:]]
    finally:
        live.close()


def test_prompts_queued_beside_running_streams_are_prefilled_a_window_per_step(model_dir, reference, monkeypatch):
    """Chunked prefill: every prefill window stalls the rows decoding, so while any decode the windows run between
    two of their steps hold at most --prefill-tokens-per-step (here 40) prompt tokens (one window always): a
    100-token prompt (chunks of 16, windows of 32) is prefilled between a stream's steps, short prompts join in one
    pass, and every answer is the one it gets alone (three long prompts at once stalled a stream 3.2 s in the
    twenty-eighth session's outside check)."""
    live = LiveServer(model_dir, engine_options=dict(prefill_chunk=16), prefill_tokens_per_step=40)
    try:
        scheduler, batch = live.scheduler, live.scheduler.batch
        events: list[tuple[str, int]] = []
        admitting: list[int] = []
        advance, step = batch.advance, batch.step
        waiting = {"for": 0}

        def stepping():
            deadline = time.monotonic() + 10
            while len(scheduler.queue) < waiting["for"] and time.monotonic() < deadline:  # all three queued first
                time.sleep(0.005)
            waiting["for"] = 0
            events.append(("step", 0))
            return step()

        def advancing(row):
            admitting.append(scheduler.snapshot()["admitting"])
            ran, first = advance(row)
            events.append(("window", ran))
            return ran, first

        def together(jobs):  # short prompts admitted at once: a window each in the record of a pass
            events.extend(("window", len(job[0])) for job in jobs)
            return admit_together(jobs)

        admit_together = batch.admit_together
        monkeypatch.setattr(batch, "advance", advancing)
        monkeypatch.setattr(batch, "admit_together", together)
        monkeypatch.setattr(batch, "step", stepping)
        streaming, _ = _timed_stream(live, 150)
        events.clear()
        waiting["for"] = 3
        prompts = [list(range(3, 103)), [5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29]]
        with ThreadPoolExecutor(3) as pool:
            def ask(prompt):
                return pool.submit(lambda: httpx.post(live.url + "/v1/completions", timeout=60, json={
                    "model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0}).json())

            futures = [ask(prompts[0])]  # the long prompt first in the queue, then the short ones
            _wait_for(lambda: len(scheduler.queue) == 1)
            futures += [ask(prompt) for prompt in prompts[1:]]
            answers = [f.result() for f in futures]
        streaming.join(timeout=60)
        assert [a["choices"][0]["text"] for a in answers] == [_alone(reference, p, 4)[0] for p in prompts]
        # between two steps: one window, or windows of at most 40 prompt tokens together
        passes, current = [], []
        for kind, tokens in events:
            if kind == "step":
                passes.append(current) if current else None
                current = []
            else:
                current.append(tokens)
        assert all(len(p) == 1 or sum(p) <= 40 for p in passes), passes
        # while the three are prefilled between the steps, the metrics count them as admitting, not active
        assert max(admitting) == 3 and 'moeprefetch_admitting_requests{model="tiny"} 0' in \
            httpx.get(live.url + "/metrics", timeout=10).text
        # the long prompt in windows of 32 (two chunks), steps between them; the short ones together
        assert sorted(t for p in passes for t in p) == [4, 10, 10, 32, 32, 32] and len(passes) >= 3, passes
        assert any(p.count(10) == 2 for p in passes), passes
    finally:
        live.close()


def test_a_long_prompt_is_refused_early_off_the_event_loop_and_streams_go_on(live, monkeypatch):
    server = live.app.state.server
    threads, parse = [], server._parse
    monkeypatch.setattr(server, "_parse", lambda raw, p: (threads.append(threading.current_thread().name),
                                                           parse(raw, p))[1])
    _slow_steps(monkeypatch, live.scheduler, 0.01)
    streaming, gaps = _timed_stream(live, 120)
    huge = "the quick brown fox " * 45_000  # 900,000 characters, under the 1 MiB body limit
    for _ in range(4):
        response = httpx.post(live.url + "/v1/completions", json={"model": "tiny", "prompt": huge}, timeout=30)
        error = _error_of(response, 400, "prompt")
        assert "900000 characters" in error["message"] and "max_seq_len=256" in error["message"]
    streaming.join(timeout=60)
    assert len(gaps) > 100 and max(gaps[1:]) < 1.0  # no chunk of the stream waited on the long prompts
    # within the character bound but over the context in tokens: tokenised (in a worker), then refused by its limit
    response = httpx.post(live.url + "/v1/completions", json={"model": "tiny", "prompt": "the quick fox " * 300},
                          timeout=30)
    error = _error_of(response, 400, "prompt")
    assert "no room" in error["message"] and "max_seq_len=256" in error["message"]
    assert len(threads) == 6 and all(name.startswith("moeprefetch-parse") for name in threads)  # with the stream


def test_a_body_longer_than_any_acceptable_request_is_refused_unread_whatever_the_body_limit(live, monkeypatch):
    """With --max-body-bytes raised to 64 MiB, a 5 MB list of token ids (more than any request this model could
    accept) is a 413 before its JSON is decoded, and a stream going on meanwhile is not held up by it."""
    import dataclasses

    server = live.app.state.server
    monkeypatch.setattr(server, "settings", dataclasses.replace(server.settings, max_body_bytes=64 << 20))
    largest = server.limits.largest_body
    assert largest < 4 << 20
    decoded = []
    parse = server._parse
    monkeypatch.setattr(server, "_parse", lambda raw, p: (decoded.append(len(raw)), parse(raw, p))[1])
    _slow_steps(monkeypatch, live.scheduler, 0.01)
    streaming, gaps = _timed_stream(live, 80)
    body = json.dumps({"model": "tiny", "prompt": [7] * 1_700_000}).encode()  # 5.1 MB
    for _ in range(3):
        response = httpx.post(live.url + "/v1/completions", content=body, timeout=30,
                              headers={"Content-Type": "application/json"})
        error = _error_of(response, 413, None)
        assert "any request this model could accept" in error["message"] and str(largest) in error["message"]
    streaming.join(timeout=60)
    assert len(decoded) == 1 and decoded[0] < 200  # only the stream's body was decoded
    assert len(gaps) > 60 and max(gaps[1:]) < 1.0
    # a list of ids longer than the context is refused by its length, before its ids are looked at
    response = httpx.post(live.url + "/v1/completions", json={"model": "tiny", "prompt": [1] * 300}, timeout=30)
    assert "300 token ids" in _error_of(response, 400, "prompt")["message"]
    response = httpx.post(live.url + "/v1/completions", json={"model": "tiny", "prompt": ["a"] * 300}, timeout=30)
    assert "has 300 token ids" not in _error_of(response, 400, "prompt")["message"]  # not ids: the general one


def test_the_largest_body_holds_every_request_the_model_could_accept():
    import random

    from moeprefetch.serve.lifecycle import listen_problem
    from moeprefetch.serve.protocol import MAX_STOP_STRINGS, Limits

    limits = Limits(model="m", context=64, max_token_chars=4, vocab=5000)
    rng = random.Random(0)
    widest = {"model": "m", "prompt": "\U0001f600" * limits.max_prompt_chars,  # each a 12-byte escape pair
              "logit_bias": {str(i): rng.uniform(-100, 100) for i in range(limits.vocab)},
              "stop": ["\U0001f600" * limits.max_prompt_chars] * MAX_STOP_STRINGS, "max_tokens": 8}
    assert len(json.dumps(widest, indent=1).encode()) <= limits.largest_body
    chat = {"model": "m", "messages": [{"role": "user", "content": ""}] * limits.context}
    assert len(json.dumps(chat, indent=2).encode()) <= limits.largest_body
    assert "not a host name" in listen_problem("a..b", 8000)  # the resolver's UnicodeError is one sentence too


def test_a_prompt_that_cannot_fit_is_refused_without_tokenising(caplog):
    from types import SimpleNamespace

    from moeprefetch.serve.app import Server
    from moeprefetch.serve.protocol import APIError, Limits, parse_chat, parse_completion

    class Untouchable:
        chat_template = None

        def __call__(self, *args, **kwargs):
            raise AssertionError("the tokenizer ran")

        def get_vocab(self):
            return {"a": 0, "abcd": 1}

    limits = Limits(model="m", context=64, max_token_chars=4)
    assert limits.max_prompt_chars == 256
    for parse, body, param in ((parse_completion, {"prompt": "y" * 257}, "prompt"),
                               (parse_chat, {"messages": [{"role": "user", "content": "y" * 200},
                                                          {"role": "user", "content": "y" * 57}]}, "messages")):
        with pytest.raises(APIError) as err:
            parse(body, Untouchable(), limits)
        assert (err.value.status, err.value.param) == (400, param) and "max_seq_len=64" in err.value.message
    # the server reads the bound from the vocabulary, and says when chat falls back to the role lines
    engine = SimpleNamespace(tokenizer=Untouchable(), options=SimpleNamespace(max_seq_len=64),
                             args=SimpleNamespace(vocab_size=2))
    scheduler = SimpleNamespace(batch=SimpleNamespace(spec=SimpleNamespace(chain=1)))
    with caplog.at_level(logging.WARNING, logger="moeprefetch.serve.app"):
        server = Server(engine, "m", scheduler)
    server.workers.shutdown()
    assert server.limits.max_token_chars == 4 and server.limits.reserve == 2 and server.limits.vocab == 2
    assert any("no chat template" in r.getMessage() and "assistant:" in r.getMessage() for r in caplog.records)


def test_requests_cut_by_the_drain_get_a_503_json_or_an_error_event_then_done(plain_model_dir, monkeypatch):
    server = LiveServer(plain_model_dir, max_batch_size=2, name="draining", drain_seconds=0.5)
    try:
        _slow_steps(monkeypatch, server.scheduler, 0.02)  # 200 tokens take 4 s: longer than the drain
        body = {"model": "draining", "prompt": [3, 4, 5], "max_tokens": 200, "temperature": 0, "ignore_eos": True}
        results: dict = {}

        def plain():
            results["plain"] = httpx.post(server.url + "/v1/completions", json=body, timeout=60)

        def stream():
            with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True},
                              timeout=60) as response:
                results["stream"] = (response.status_code, [line for line in response.iter_lines() if line])

        clients = [threading.Thread(target=plain), threading.Thread(target=stream)]
        for client in clients:
            client.start()
        _wait_for(lambda: server.scheduler.snapshot()["active"] == 2)
        server.server.handle_exit(signal.SIGTERM, None)  # what uvicorn does on the signal
        _wait_for(lambda: server.app.state.server.draining)
        # while draining the listener still answers: a 503 JSON error, not a refused connection
        late = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
        _error_of(late, 503, None)
        assert late.headers["retry-after"] == "1"
        assert httpx.get(server.url + "/health", timeout=30).json()["status"] == "draining"
        for client in clients:
            client.join(timeout=30)
        error = _error_of(results["plain"], 503, None)
        assert "shut down before this request finished" in error["message"]
        status, lines = results["stream"]
        assert status == 200 and lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][6:])["error"]["code"] == "service_unavailable"
        assert len(lines) > 3  # tokens had streamed before the cut
        server.thread.join(timeout=30)
        assert not server.thread.is_alive()
    finally:
        server.close()


@pytest.mark.parametrize("signals", [(signal.SIGINT, signal.SIGINT),
                                     pytest.param((signal.SIGTERM, signal.SIGTERM), marks=pytest.mark.slow)],
                         ids=["sigint-twice", "sigterm-twice"])  # the fast lane: Ctrl-C twice (issue 40)
def test_a_second_signal_exits_cleanly_with_requests_in_flight(model_dir, signals):
    process, url = _cli_server(model_dir, "--drain-seconds", "30")
    answers: list = []

    def ask(i):
        response = httpx.post(url + "/v1/completions", timeout=60,
                              json={"model": "tiny", "prompt": [3, 4, 5 + i], "max_tokens": 240, "temperature": 0,
                                    "ignore_eos": True})
        answers.append((response.status_code, response.json()))

    try:
        clients = [threading.Thread(target=ask, args=(i,)) for i in range(6)]  # three waves through two rows
        for client in clients:
            client.start()
        _wait_for(lambda: 'moeprefetch_active_requests{model="tiny"} 2' in httpx.get(url + "/metrics", timeout=5).text)
        process.send_signal(signals[0])
        time.sleep(0.3)
        process.send_signal(signals[1])
        code = process.wait(timeout=60)
        stderr = process.stderr.read()
        for client in clients:
            client.join(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    assert code == 130, stderr  # the CLI's "interrupted", not an abort (134, -6)
    assert "terminate called" not in stderr and "Traceback" not in stderr, stderr
    assert len(answers) == 6 and {status for status, _ in answers} <= {200, 503}
    cut = [body for status, body in answers if status == 503]
    # a request still queued when the drain began is refused as the server shuts down (timing decides which)
    assert cut and all(("shut down" in body["error"]["message"] or "shutting down" in body["error"]["message"])
                       for body in cut)


def test_unknown_paths_and_wrong_methods_are_openai_json_errors(live):
    error = _error_of(httpx.get(live.url + "/nope", timeout=30), 404)
    assert "/nope" in error["message"] and "/v1" in error["message"]
    response = httpx.get(live.url + "/v1/completions", timeout=30)
    error = _error_of(response, 405)
    assert response.headers["allow"] == "POST" and "POST" in error["message"]
    _error_of(httpx.delete(live.url + "/v1/models", timeout=30), 405)
    card = live.client.models.retrieve("tiny")
    assert (card.id, card.object, card.owned_by) == ("tiny", "model", "moeprefetch")
    error = _error_of(httpx.get(live.url + "/v1/models/other", timeout=30), 404, "model")
    assert error["code"] == "model_not_found" and error["type"] == "not_found_error" and "'other'" in error["message"]
    with pytest.raises(openai.NotFoundError):
        live.client.models.retrieve("org/other")
    # a trailing slash: served where a route takes it, else a JSON 404 (never an empty redirect)
    listed = httpx.get(live.url + "/v1/models/", timeout=30)
    assert listed.status_code == 200 and [m["id"] for m in listed.json()["data"]] == ["tiny"]
    slashed = httpx.post(live.url + "/v1/completions/", timeout=30, json={"model": "tiny", "prompt": "a"})
    assert _error_of(slashed, 404)["code"] == "not_found"


def test_deep_json_and_lone_surrogates_are_one_sentence_400s(live):
    headers = {"Content-Type": "application/json"}

    def post(raw: bytes, path: str = "/v1/completions"):
        return httpx.post(live.url + path, content=raw, headers=headers, timeout=30)

    error = _error_of(post(b"[" * 100_000 + b"]" * 100_000), 400, None)
    assert "too deeply" in error["message"]
    error = _error_of(post(b'{"model": "tiny", "prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"), 400, None)
    assert "too deeply" in error["message"]
    for raw, path, param in [
        (b'{"model": "tiny", "prompt": "a\\ud800b"}', "/v1/completions", "prompt"),
        (b'{"model": "tiny", "prompt": "x", "stop": "\\udfff"}', "/v1/completions", "stop"),
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}', "/v1/chat/completions",
         "messages[0].content"),
    ]:
        error = _error_of(post(raw, path), 400, param)
        assert "lone UTF-16 surrogate" in error["message"]
    error = _error_of(post(b'{"model": "tiny", "prompt": "\xed\xa0\x80"}'), 400, None)  # a surrogate as UTF-8 bytes
    assert "UTF-8" in error["message"]
    # a byte-order mark before the JSON is ignored (RFC 8259 allows it); a second one is not JSON
    answer = post(b'\xef\xbb\xbf{"model": "tiny", "prompt": "a", "max_tokens": 2}')
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 2
    error = _error_of(post(b'\xef\xbb\xbf\xef\xbb\xbf{"model": "tiny", "prompt": "a"}'), 400, None)
    assert "not valid JSON" in error["message"]
    # integers longer than Python converts (4,300 digits): as a value, and as a logit_bias key
    error = _error_of(post(b'{"model": "tiny", "prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}"), 400, None)
    assert "number too long" in error["message"]
    error = _error_of(post(b'{"model": "tiny", "prompt": "x", "logit_bias": {"1' + b"0" * 5000 + b'": 1}}'), 400,
                      "logit_bias")
    assert "token ids" in error["message"]
    pair = post(b'{"model": "tiny", "prompt": "\\ud83d\\ude00 fox", "max_tokens": 2}')  # a valid pair: an emoji
    assert pair.status_code == 200 and pair.json()["usage"]["completion_tokens"] >= 1
    assert httpx.get(live.url + "/health", timeout=30).json()["status"] == "ok"


def test_chat_without_a_template_uses_role_lines_and_joins_text_parts(guarded, reference):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the quick"}]
    chat = guarded.client.chat.completions.create(model="guarded", messages=messages, max_tokens=8, temperature=0)
    ids = reference.tokenizer("system: be brief\nuser: the quick\nassistant:")["input_ids"]
    assert chat.usage.prompt_tokens == len(ids)
    assert chat.choices[0].message.content == _alone(reference, ids, 8)[0]
    parts = [{"role": "user", "content": [{"type": "text", "text": "the"}, {"type": "text", "text": "quick"}]}]
    via_parts = guarded.client.chat.completions.create(model="guarded", messages=parts, max_tokens=6, temperature=0)
    joined = guarded.client.chat.completions.create(model="guarded", messages=[{"role": "user", "content":
                                                                                "the\nquick"}],
                                                    max_tokens=6, temperature=0)
    assert via_parts.usage.prompt_tokens == joined.usage.prompt_tokens
    assert via_parts.choices[0].message.content == joined.choices[0].message.content
    image = [{"role": "user", "content": [{"type": "text", "text": "what is this"},
                                          {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]
    response = httpx.post(guarded.url + "/v1/chat/completions", headers=AUTH, timeout=30,
                          json={"model": "guarded", "messages": image})
    error = _error_of(response, 400, "messages[0].content")
    assert "'image_url' part" in error["message"]
    # an assistant turn with null content (what OpenAI's clients send after a tool call) is empty text; a user's
    # null content is refused; a role is one of OpenAI's (a long made-up one was tokenised in full before)
    turns = [{"role": "user", "content": "the quick"}, {"role": "assistant", "content": None},
             {"role": "user", "content": "fox"}]
    null = guarded.client.chat.completions.create(model="guarded", messages=turns, max_tokens=4, temperature=0)
    empty = guarded.client.chat.completions.create(model="guarded", messages=[dict(m, content=m["content"] or "")
                                                                              for m in turns],
                                                   max_tokens=4, temperature=0)
    assert null.usage.prompt_tokens == empty.usage.prompt_tokens
    assert null.choices[0].message.content == empty.choices[0].message.content
    response = httpx.post(guarded.url + "/v1/chat/completions", headers=AUTH, timeout=30,
                          json={"model": "guarded", "messages": [{"role": "user", "content": None}]})
    _error_of(response, 400, "messages[0].content")
    response = httpx.post(guarded.url + "/v1/chat/completions", headers=AUTH, timeout=30,
                          json={"model": "guarded", "messages": [{"role": "r" * 60_000, "content": "x"}]})
    assert "messages[0].role must be one of system" in _error_of(response, 400, "messages[0].role")["message"]


def test_parameters_the_server_cannot_honour_are_refused_by_name(live):
    refused = {"top_logprobs": 3, "suffix": " the end", "best_of": 3, "response_format": {"type": "json_object"},
               "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"}
    for name, value in refused.items():
        response = httpx.post(live.url + "/v1/completions", timeout=30,
                              json={"model": "tiny", "prompt": "x", name: value})
        assert name in _error_of(response, 400, name)["message"]
    for name, value in (("echo", True), ("logprobs", 3), ("top_logprobs", 2)):
        response = httpx.post(live.url + "/v1/chat/completions", timeout=30,
                              json={"model": "tiny", "messages": [{"role": "user", "content": "x"}], name: value})
        _error_of(response, 400, name)
    # honoured parameters out of range, or of the wrong shape, are named too
    for name, value in (("logprobs", 21), ("logprobs", True), ("logit_bias", {"5": 101}), ("logit_bias", [5]),
                        ("logit_bias", {"99999999": 1}), ("presence_penalty", 2.5), ("frequency_penalty", "x")):
        response = httpx.post(live.url + "/v1/completions", timeout=30,
                              json={"model": "tiny", "prompt": "x", name: value})
        _error_of(response, 400, name)
    response = httpx.post(live.url + "/v1/completions", timeout=30,
                          json={"model": "tiny", "prompt": "x", "echo": True, "logprobs": 1})
    assert "prompt's log-probabilities" in _error_of(response, 400, "echo")["message"]
    # keys that only look like integers and numbers beyond any float are 400s too, not 500s
    huge = json.loads("1" + "0" * 400)
    for name, value in (("logit_bias", {"--1": 1}), ("logit_bias", {"\u00b2": 1}), ("logit_bias", {"1": huge}),
                        ("presence_penalty", huge), ("temperature", huge)):
        response = httpx.post(live.url + "/v1/completions", timeout=30,
                              content=json.dumps({"model": "tiny", "prompt": "x", name: value}),
                              headers={"Content-Type": "application/json"})
        _error_of(response, 400, name)
    # the values that ask for nothing pass
    noops = {"logprobs": None, "top_logprobs": 0, "presence_penalty": 0, "frequency_penalty": 0.0, "best_of": 1,
             "logit_bias": {},
             "response_format": {"type": "text"}, "suffix": None, "tools": [], "tool_choice": "none"}
    response = httpx.post(live.url + "/v1/completions", timeout=30,
                          json={"model": "tiny", "prompt": "x", "max_tokens": 2, **noops})
    assert response.status_code == 200, response.text
    response = httpx.post(live.url + "/v1/chat/completions", timeout=30,
                          json={"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
                                "logprobs": False})
    assert response.status_code == 200, response.text


def test_echo_returns_the_prompt_before_the_completion(live, reference):
    prompt = PROMPTS[0]
    answer = live.client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0, echo=True)
    assert answer.choices[0].text == prompt + _alone(reference, prompt, 6)[0]
    assert answer.usage.completion_tokens == _alone(reference, prompt, 6)[1]
    streamed = live.client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0, echo=True,
                                              stream=True)
    assert "".join(c.choices[0].text for c in streamed) == answer.choices[0].text
    ids = live.client.completions.create(model="tiny", prompt=[3, 4, 5], max_tokens=3, temperature=0, echo=True)
    prefix = reference.tokenizer.decode([3, 4, 5], skip_special_tokens=True)
    assert ids.choices[0].text == prefix + _alone(reference, [3, 4, 5], 3)[0]


def test_an_api_key_is_required_on_v1_and_compared_in_constant_time(guarded, monkeypatch):
    from moeprefetch.serve import guards

    compared, real = [], guards.hmac.compare_digest
    monkeypatch.setattr(guards.hmac, "compare_digest", lambda a, b: (compared.append((a, b)), real(a, b))[1])
    body = {"model": "guarded", "prompt": "x", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        response = httpx.post(guarded.url + "/v1/completions", json=body, headers=headers, timeout=30)
        assert _error_of(response, 401, None)["code"] == "invalid_api_key"
        assert response.headers["www-authenticate"] == "Bearer"
    assert (b"wrong", API_KEY.encode()) in compared
    _error_of(httpx.get(guarded.url + "/v1/models", timeout=30), 401, None)
    _error_of(httpx.get(guarded.url + "/v1/nothing-here", timeout=30), 401, None)  # no route is told before the key
    assert httpx.post(guarded.url + "/v1/completions", json=body, headers=AUTH, timeout=30).status_code == 200
    assert httpx.get(guarded.url + "/health", timeout=30).status_code == 200  # health and metrics stay open
    assert httpx.get(guarded.url + "/metrics", timeout=30).status_code == 200
    wrong = openai.OpenAI(base_url=guarded.url + "/v1", api_key="wrong", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    assert [m.id for m in guarded.client.models.list().data] == ["guarded"]


def test_serve_options_and_the_api_key_from_the_environment(monkeypatch):
    from moeprefetch.cli import _parser, main
    from moeprefetch.serve.guards import default_allowed_hosts

    monkeypatch.setenv("MOEPREFETCH_API_KEY", "from-env")
    assert _parser().parse_args(["serve"]).api_key == "from-env"
    assert _parser().parse_args(["serve", "--api-key", "given"]).api_key == "given"
    monkeypatch.delenv("MOEPREFETCH_API_KEY")
    ns = _parser().parse_args(["serve"])
    assert (ns.api_key, ns.max_body_bytes, ns.body_timeout, ns.allowed_hosts) == (None, 1 << 20, 30.0, None)
    assert default_allowed_hosts("127.0.0.1") == default_allowed_hosts("::1") == ["localhost", "127.0.0.1", "::1"]
    assert default_allowed_hosts("0.0.0.0") is None and default_allowed_hosts("example.org") is None
    assert main(["serve", "--max-body-bytes", "0"]) == 2  # refused before the model loads
    assert main(["serve", "--body-timeout", "0"]) == 2
    assert ns.prefill_tokens_per_step == 512 and main(["serve", "--prefill-tokens-per-step", "0"]) == 2
    assert ns.admit_wait_ms == 2.0 and main(["serve", "--admit-wait-ms", "nan"]) == 2
    assert main(["serve", "--admit-wait-ms", "-1"]) == 2 and main(["serve", "--admit-wait-ms", "5000"]) == 2
    assert main(["serve", "--allowed-hosts", " , "]) == 2
    assert main(["serve", "--model-name", " "]) == 2  # clients send it: an empty one could never be asked for
    assert main(["serve", "--bypass"]) == 2  # acts on the learned head only: refused before the model loads
    # an empty key (`--api-key "$KEY"` with KEY unset) would serve everyone: refused, from either source
    assert main(["serve", "--api-key", ""]) == 2
    monkeypatch.setenv("MOEPREFETCH_API_KEY", " ")
    assert main(["serve"]) == 2


def test_serve_on_a_port_in_use_is_one_sentence_before_the_model_loads(monkeypatch, capsys):
    from moeprefetch import engine as engine_module
    from moeprefetch.cli import main

    monkeypatch.setattr(engine_module.MoEPrefetchEngine, "from_pretrained",
                        classmethod(lambda *a, **k: (_ for _ in ()).throw(AssertionError("the model loaded"))))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "--host", "127.0.0.1", "--port", str(port)]) == 2
    captured = capsys.readouterr()
    assert f"cannot listen on 127.0.0.1:{port}" in captured.err and "serving" not in captured.out
    monkeypatch.undo()  # the CLI's generate refuses a seed outside the sampler's range (it used to alias it)
    assert main(["generate", "--prompt", "x", "--seed", str(2**63)]) == 2
    assert "seed must be an integer in [-2**63, 2**63)" in capsys.readouterr().err


def test_foreign_host_headers_and_non_json_bodies_are_refused(guarded):
    response = httpx.get(guarded.url + "/health", headers={"Host": "attacker.example"}, timeout=30)
    assert _error_of(response, 400, None)["code"] == "invalid_host"
    response = httpx.get(guarded.url + "/v1/models", headers={**AUTH, "Host": f"localhost:{guarded.port}"}, timeout=30)
    assert response.status_code == 200
    raw = json.dumps({"model": "guarded", "prompt": "x", "max_tokens": 2}).encode()
    for content_type in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = {**AUTH, **({"Content-Type": content_type} if content_type else {})}
        response = httpx.post(guarded.url + "/v1/completions", content=raw, headers=headers, timeout=30)
        assert "application/json" in _error_of(response, 415, None)["message"]
    response = httpx.post(guarded.url + "/v1/completions", content=raw, timeout=30,
                          headers={**AUTH, "Content-Type": "application/json; charset=utf-8"})
    assert response.status_code == 200


def test_an_aborted_upload_logs_one_line(live, caplog):
    uvicorn_errors = logging.getLogger("uvicorn.error")  # uvicorn's loggers do not reach the root logger
    uvicorn_errors.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO):
            with socket.create_connection(("127.0.0.1", live.port), timeout=10) as sock:
                sock.sendall(_raw_head("/v1/completions", 1000, live.port) + b'{"model": "tiny", "prompt": ')
                time.sleep(0.2)
            _wait_for(lambda: any("went away" in r.getMessage() for r in caplog.records), 10)
            time.sleep(0.2)
    finally:
        uvicorn_errors.removeHandler(caplog.handler)
    lines = [r for r in caplog.records if "went away" in r.getMessage()]
    assert len(lines) == 1 and lines[0].exc_info is None and "/v1/completions" in lines[0].getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert httpx.get(live.url + "/health", timeout=30).json()["status"] == "ok"


def test_a_half_sent_body_times_out_with_a_408(guarded):
    with socket.create_connection(("127.0.0.1", guarded.port), timeout=10) as sock:
        sock.sendall(_raw_head("/v1/completions", 100, guarded.port, f"Authorization: Bearer {API_KEY}\r\n")
                     + b'{"prompt"')
        started = time.monotonic()
        reply = _read_reply(sock)
        elapsed = time.monotonic() - started
    assert reply.startswith(b"HTTP/1.1 408") and b'"request_timeout"' in reply
    assert 0.8 < elapsed < 5  # the 1 s body timeout, not the client's 10 s
    assert httpx.get(guarded.url + "/health", timeout=30).status_code == 200


def test_headers_trickled_a_byte_at_a_time_time_out_with_a_408_and_idle_connections_stay(guarded):
    """A client that begins a request and trickles its headers (a byte every 0.2 s, which stops uvicorn's keep-alive
    timer each time) is answered 408 JSON and disconnected after the 1 s deadline; a connection that sends nothing
    stays open for its keep-alive, and one that then sends a whole request is answered."""
    with socket.create_connection(("127.0.0.1", guarded.port), timeout=10) as idle:
        with socket.create_connection(("127.0.0.1", guarded.port), timeout=10) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            started, reply = time.monotonic(), b""
            for byte in b"X-Slow: " + b"a" * 100:
                try:
                    sock.sendall(bytes([byte]))
                except OSError:  # the server closed the connection
                    break
                time.sleep(0.2)
                if time.monotonic() - started > 6:
                    break
            sock.settimeout(5)
            try:
                reply = _read_reply(sock)
            except OSError:
                pass
            elapsed = time.monotonic() - started
        assert reply.startswith(b"HTTP/1.1 408") and b'"request_timeout"' in reply, reply
        assert elapsed < 4
        idle.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert _read_reply(idle).startswith(b"HTTP/1.1 200")


def test_a_body_still_arriving_when_a_shutdown_begins_gets_a_503_json(live):
    """A request whose body is still arriving when the drain begins was never taken: it is answered 503 JSON at
    once (not cut later by uvicorn's own shutdown as a text/plain 500, the twenty-eighth session's outside check)."""
    server = live.app.state.server
    with socket.create_connection(("127.0.0.1", live.port), timeout=10) as sock:
        sock.sendall(_raw_head("/v1/completions", 100, live.port) + b'{"prompt"')
        time.sleep(0.3)  # the handler is waiting for the rest of the body
        server.draining = True
        try:
            started = time.monotonic()
            reply = _read_reply(sock)
            elapsed = time.monotonic() - started
        finally:
            server.draining = False
    assert reply.startswith(b"HTTP/1.1 503") and b"application/json" in reply and b"shutting down" in reply
    assert elapsed < 2
    assert httpx.get(live.url + "/health", timeout=30).json()["status"] == "ok"


def test_queued_streams_whose_client_left_are_never_prefilled(plain_model_dir, monkeypatch):
    server = LiveServer(plain_model_dir, max_batch_size=1, name="single")
    try:
        batch, admitted = server.scheduler.batch, []
        begin = batch.begin
        monkeypatch.setattr(batch, "begin", lambda prompt, *a, **k: (admitted.append(list(prompt)),
                                                                     begin(prompt, *a, **k))[1])
        _slow_steps(monkeypatch, server.scheduler, 0.01)
        body = {"model": "single", "prompt": [3, 4, 5], "max_tokens": 150, "temperature": 0, "ignore_eos": True}
        long = threading.Thread(target=httpx.post, args=(server.url + "/v1/completions",),
                                kwargs=dict(json=body, timeout=60))
        long.start()
        _wait_for(lambda: server.scheduler.snapshot()["active"] == 1)
        sockets = []
        for i in range(3):
            raw = json.dumps({**body, "prompt": [7, 8, 9 + i], "stream": True}).encode()
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
            sock.sendall(_raw_head("/v1/completions", len(raw), server.port) + raw)
            sockets.append(sock)
        _wait_for(lambda: server.scheduler.snapshot()["queue_depth"] == 3)
        for sock in sockets:
            sock.close()
        _wait_for(lambda: server.scheduler.snapshot()["requests"]["cancelled"] == 3)
        assert server.scheduler.snapshot()["active"] == 1  # the long request still runs
        long.join(timeout=60)
        state = server.scheduler.snapshot()
        assert admitted == [[3, 4, 5]] and state["prompt_tokens"] == 3 and state["queue_depth"] == 0
    finally:
        server.close()


def test_max_tokens_is_clamped_to_the_context_and_a_full_prompt_is_a_400(live):
    limits = live.app.state.server.limits
    assert (limits.context, limits.reserve) == (256, 2)
    prompt = [3, 4, 5] * 60  # 180 tokens
    response = httpx.post(live.url + "/v1/completions", timeout=60,
                          json={"model": "tiny", "prompt": prompt, "max_tokens": 10**6, "temperature": 0,
                                "ignore_eos": True})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 256 - 2 - 180
    assert response.json()["choices"][0]["finish_reason"] == "length"
    response = httpx.post(live.url + "/v1/completions", json={"model": "tiny", "prompt": [3] * 254}, timeout=30)
    error = _error_of(response, 400, "prompt")
    assert "254 tokens" in error["message"] and "max_seq_len=256" in error["message"]


def test_seeds_are_64_bit_signed_integers(live):
    """OpenAI's seed is an int64: negative seeds and those past 2**62 are served, each with draws of its own (the
    sampler once hashed 62 bits, so -1 drew 2**62 - 1's tokens), the same every time; 65-bit seeds are refused."""
    for seed in (2**63, -(2**63) - 1):
        response = httpx.post(live.url + "/v1/completions", timeout=30,
                              json={"model": "tiny", "prompt": "x", "seed": seed})
        assert "[-9223372036854775808, 9223372036854775808)" in _error_of(response, 400, "seed")["message"]
    texts = {}
    for seed in (2**62 - 1, -1, 2**62, 0, -(2**63), 2**63 - 1):
        body = {"model": "tiny", "prompt": "the quick", "seed": seed, "temperature": 1.5, "max_tokens": 12}
        texts[seed], again = (httpx.post(live.url + "/v1/completions", json=body, timeout=30).json()["choices"][0]
                              ["text"] for _ in range(2))
        assert texts[seed] == again
    assert len(set(texts.values())) == len(texts), texts


def test_64_concurrent_requests_are_each_answered(live):
    """Every request is completed, or refused with 429/503 and a JSON body: none is lost or answered in text."""
    def ask(i):
        stream = i % 4 == 0
        response = httpx.post(live.url + "/v1/completions", timeout=120,
                              json={"model": "tiny", "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 8,
                                    "temperature": 0, "stream": stream})
        return stream, response

    with ThreadPoolExecutor(64) as pool:
        results = list(pool.map(ask, range(64)))
    completed = 0
    for stream, response in results:
        if response.status_code != 200:
            assert _error_of(response, response.status_code)["type"] in ("rate_limit_error", "server_error")
            assert response.status_code in (429, 503) and response.headers["retry-after"] == "1"
        elif stream:
            lines = [line for line in response.text.splitlines() if line]
            assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["choices"][0]["finish_reason"]
            completed += 1
        else:
            assert response.json()["choices"][0]["finish_reason"] in ("length", "stop")
            completed += 1
    assert completed >= 32  # a refusal means the queue held 32, and those were all served
    assert live.scheduler.snapshot()["active"] == 0


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.slow  # the fast lane: disconnected clients free their rows, queued ones are never prefilled
@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads the resident size from /proc")
def test_a_disconnect_storm_leaves_the_server_healthy_and_memory_flat(live, monkeypatch):
    from moeprefetch.serve.scheduler import Handle

    _slow_steps(monkeypatch, live.scheduler, 0.005)  # 200 tokens outlast the client's first chunk
    body = {"model": "tiny", "max_tokens": 200, "temperature": 0.7, "ignore_eos": True, "stream": True}

    def drop(i):
        with httpx.stream("POST", live.url + "/v1/completions", json={**body, "prompt": PROMPTS[i % 8]},
                          timeout=60) as response:
            assert response.status_code == 200
            next(response.iter_lines())  # one chunk, then the client leaves mid-stream

    def storm():
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(drop, range(32)))
        # idle: no row, no queue, and no request taken off the queue for admission (its cancellation not yet counted)
        _wait_for(lambda: (lambda s: s["active"] == s["queue_depth"] == s["admitting"] == 0)(
            live.scheduler.snapshot()), 60)

    before = live.scheduler.snapshot()["requests"]["cancelled"]
    storm()
    gc.collect()
    rss = _rss_bytes()
    storm()
    storm()
    gc.collect()
    assert _rss_bytes() - rss < 32 * 2**20  # two more storms of 32 leave the process no larger
    # a dropped row leaves the rows before its cancellation is counted: wait for the count, then check it exactly
    _wait_for(lambda: live.scheduler.snapshot()["requests"]["cancelled"] - before >= 96, 30)
    assert live.scheduler.snapshot()["requests"]["cancelled"] - before == 96
    assert sum(type(o) is Handle for o in gc.get_objects()) == 0  # nothing holds the dropped requests
    assert httpx.get(live.url + "/health", timeout=30).json() == {"status": "ok", "active": 0, "queue_depth": 0}
    assert live.client.completions.create(model="tiny", prompt="x", max_tokens=3, temperature=0).choices


def test_logprobs_bias_and_penalties_are_what_engine_generate_gives(live, reference):
    """Completions' logprobs (with text offsets) and chat's (with bytes), streamed and not, logit_bias and both
    penalties: the tokens and log-probabilities of `engine.generate` with the same arguments."""
    prompt, tokenizer = PROMPTS[1], reference.tokenizer
    plain = reference.generate([prompt], 8, stop_at_eos=False).sequences[0]
    bias = {plain[0]: -100.0, plain[2]: 4.0}
    kwargs = dict(logit_bias=bias, presence_penalty=0.7, frequency_penalty=0.5)
    alone = reference.generate([prompt], 8, logprobs=3, **kwargs)
    assert alone.sequences[0] != plain and plain[0] not in alone.sequences[0]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 3,
            "logit_bias": {str(k): v for k, v in bias.items()}, "presence_penalty": 0.7, "frequency_penalty": 0.5}
    answer = httpx.post(live.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    expected_tokens = [tokenizer.decode([e.token]) for e in alone.logprobs[0]]
    logprobs = answer["logprobs"]
    assert answer["text"] == alone.texts[0] and logprobs["tokens"] == expected_tokens
    assert max(abs(a - e.logprob) for a, e in zip(logprobs["token_logprobs"], alone.logprobs[0])) < 1e-5
    # each top_logprobs holds the alternatives and the chosen token (OpenAI's up to logprobs + 1)
    assert [set(top) for top in logprobs["top_logprobs"]] == [
        {tokenizer.decode([t]) for t, _ in e.top} | {tokenizer.decode([e.token])} for e in alone.logprobs[0]]
    # each token's text stands at its offset in the choice's text
    assert all(answer["text"].startswith(token, offset)
               for token, offset in zip(expected_tokens, logprobs["text_offset"]))
    assert logprobs["text_offset"] == sorted(logprobs["text_offset"]) and logprobs["text_offset"][0] == 0
    chunks = list(live.client.completions.create(stream=True, **{k: v for k, v in body.items()}))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert streamed == expected_tokens
    offsets = [o for c in chunks if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert offsets == logprobs["text_offset"]

    messages = [{"role": "user", "content": prompt}]
    chat_prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(chat_prompt, "keys"):
        chat_prompt = chat_prompt["input_ids"]
    chat_alone = reference.generate([list(chat_prompt)], 6, logprobs=2, **kwargs)
    chat = live.client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                               logprobs=True, top_logprobs=2, logit_bias=body["logit_bias"],
                                               presence_penalty=0.7, frequency_penalty=0.5)
    content = chat.choices[0].logprobs.content
    assert [c.token for c in content] == [tokenizer.decode([e.token]) for e in chat_alone.logprobs[0]]
    from moeprefetch.serve.logprobs import token_bytes

    assert [c.bytes for c in content] == [token_bytes(tokenizer, e.token) for e in chat_alone.logprobs[0]]
    assert all(c.bytes == list(c.token.encode()) or "\ufffd" in c.token for c in content)  # whole characters' own
    assert all(len(c.top_logprobs) <= 2 for c in content)
    assert max(abs(c.logprob - e.logprob) for c, e in zip(content, chat_alone.logprobs[0])) < 1e-5
    streamed = live.client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                                   logprobs=True, top_logprobs=2, stream=True,
                                                   logit_bias=body["logit_bias"], presence_penalty=0.7,
                                                   frequency_penalty=0.5)
    tokens = [c.token for chunk in streamed if chunk.choices and chunk.choices[0].logprobs
              for c in chunk.choices[0].logprobs.content]
    assert tokens == [c.token for c in content]
    no_logprobs = live.client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    assert no_logprobs.choices[0].logprobs is None


def test_a_token_inside_a_character_is_offset_where_the_character_begins():
    """Completions' text_offset for byte tokens: the shipped model's tokenizer spells 'é' as two byte tokens (ids 130
    and 105, forced by logit_bias); both stand at the character's start, as the text's offsets count characters."""
    import moeprefetch

    server = LiveServer(Path(moeprefetch.__file__).parent / "reference_model", name="ref")
    try:
        body = {"model": "ref", "prompt": "Caf", "max_tokens": 8, "temperature": 0, "logprobs": 1,
                "logit_bias": {"130": 8, "105": 8}}
        choice = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
        assert choice["text"] == "éééé"
        assert choice["logprobs"]["text_offset"] == [0, 0, 1, 1, 2, 2, 3, 3]
    finally:
        server.close()


def test_parameters_no_endpoint_reads_are_refused_by_name_and_labels_pass(live):
    """Issue 40: nothing silently ignored. A parameter neither endpoint reads (vLLM's min_p and
    repetition_penalty change sampling) is a 400 naming it, as OpenAI's API answers; user and metadata label a
    request and change nothing; a message echoed back from an answer (OpenAI's clients send its null fields) passes."""
    for url, body in (("/v1/completions", {"prompt": "x"}),
                      ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        for name, value in (("frobnicate", 1), ("min_p", 0.1), ("repetition_penalty", 1.2), ("\ud800", 1),
                            ("reasoning_effort", "high"), ("store", True)):
            response = httpx.post(live.url + url, timeout=30, headers={"Content-Type": "application/json"},
                                  content=json.dumps({"model": "tiny", **body, name: value}))
            error = _error_of(response, 400, name)
            assert json.dumps(name) in error["message"] or name in error["message"], error
        labelled = {"model": "tiny", **body, "max_tokens": 2, "temperature": 0, "user": "u-1",
                    "metadata": {"team": "x"}, "parallel_tool_calls": False, "service_tier": "auto", "store": False}
        assert httpx.post(live.url + url, timeout=30, json=labelled).status_code == 200
        conflict = {"model": "tiny", **body, "max_tokens": 4, "max_completion_tokens": 2}
        _error_of(httpx.post(live.url + url, timeout=30, json=conflict), 400, "max_completion_tokens")
    response = httpx.post(live.url + "/v1/completions", timeout=30,
                          json={"model": "tiny", "messages": [{"role": "user", "content": "x"}]})
    assert "/v1/completions" in _error_of(response, 400, "messages")["message"]
    echoed = {"role": "assistant", "content": "fine", "refusal": None, "tool_calls": None, "function_call": None,
              "audio": None, "annotations": []}
    turns = [{"role": "user", "content": "the quick"}, echoed, {"role": "user", "content": "fox"}]
    plain = [{"role": "user", "content": "the quick"}, {"role": "assistant", "content": "fine"},
             {"role": "user", "content": "fox"}]
    answers = [httpx.post(live.url + "/v1/chat/completions", timeout=30,
                          json={"model": "tiny", "messages": m, "max_tokens": 3, "temperature": 0}).json()
               for m in (turns, plain)]
    assert answers[0]["choices"][0]["message"] == answers[1]["choices"][0]["message"]
    assert answers[0]["usage"] == answers[1]["usage"]
    called = dict(echoed, tool_calls=[{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}])
    response = httpx.post(live.url + "/v1/chat/completions", timeout=30,
                          json={"model": "tiny", "messages": [called, {"role": "user", "content": "x"}]})
    assert "tool_calls" in _error_of(response, 400, "messages[0]")["message"]


def test_every_parameter_of_openais_client_is_known_and_vllms_neutral_extras_pass():
    """Each parameter the official client can send to an endpoint is read, labelled or refused by name as not
    supported (never 'unknown'); vLLM's sampling extras pass at their neutral values and are refused otherwise; a
    tool result's tool_call_id reaches the template and an earlier answer's reasoning is dropped."""
    from openai.types import completion_create_params as completions
    from openai.types.chat import completion_create_params as chat

    from moeprefetch.serve.protocol import (CHAT_PARAMS, COMPLETION_PARAMS, APIError, Limits, parse_chat,
                                            parse_completion)

    assert set(completions.CompletionCreateParamsBase.__annotations__) <= COMPLETION_PARAMS
    assert set(chat.CompletionCreateParamsBase.__annotations__) <= CHAT_PARAMS

    class Lines:
        chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"  # present

        def apply_chat_template(self, messages, add_generation_prompt, tokenize):
            self.seen = messages
            return [1, 2, 3]

    limits = Limits(model="m", context=64)
    neutral = {"min_p": 0.0, "repetition_penalty": 1.0, "min_tokens": 0, "stop_token_ids": [],
               "skip_special_tokens": True, "chat_template_kwargs": {}, "safety_identifier": "s",
               "prompt_cache_key": "k", "verbosity": "medium"}
    parse_completion({"prompt": [1, 2], **neutral}, None, limits)
    for name, value in (("min_p", 0.05), ("repetition_penalty", 1.1), ("verbosity", "low"), ("moderation", {})):
        with pytest.raises(APIError, match=f"{name} is not supported by this server") as err:
            parse_completion({"prompt": [1, 2], name: value}, None, limits)
        assert err.value.param == name
    with pytest.raises(APIError, match="safety_identifier must be a string"):
        parse_completion({"prompt": [1, 2], "safety_identifier": 5}, None, limits)
    tokenizer = Lines()
    parse_chat({"messages": [{"role": "user", "content": "x"},
                             {"role": "assistant", "content": "y", "reasoning_content": "thought"},
                             {"role": "tool", "content": "42", "tool_call_id": "call-1"}]}, tokenizer, limits)
    assert tokenizer.seen == [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"},
                              {"role": "tool", "content": "42", "tool_call_id": "call-1"}]
    deep: list = []
    for _ in range(990):  # nested nearly as deep as the decoder allows: a 400, not a 500
        deep = [deep]
    with pytest.raises(APIError, match="temperature must be a number, got a deeply nested list"):
        parse_completion({"prompt": [1, 2], "temperature": deep}, None, limits)


def test_refusals_quote_the_values_as_json_and_bound_what_the_tokenizer_would_see():
    """Error sentences show what the client sent in JSON's spelling; a named participant reaches the prompt; more
    messages than the context has tokens, or a stop string longer than any text it holds, are refused before the
    tokenizer runs; max_tokens and max_completion_tokens agree or are refused."""
    from moeprefetch.serve.protocol import APIError, Limits, fallback_chat_prompt, parse_chat, parse_completion

    class Untouchable:
        chat_template = None

        def __call__(self, *args, **kwargs):
            raise AssertionError("the tokenizer ran")

    limits = Limits(model="m", context=64, max_token_chars=4)
    for body, param, quoted in (({"temperature": "0.5"}, "temperature", 'got "0.5"'),
                                ({"logprobs": True}, "logprobs", "got true"),
                                ({"max_tokens": 2.0}, "max_tokens", "got 2.0"),
                                ({"stream": "yes"}, "stream", 'got "yes"'),
                                ({"user": 7}, "user", "got 7"),
                                ({"stop": ["z" * 257]}, "stop", "max_seq_len=64"),
                                ({"max_tokens": 3, "max_completion_tokens": 5}, "max_completion_tokens", "differ")):
        with pytest.raises(APIError) as err:
            parse_completion({"prompt": [1, 2], **body}, Untouchable(), limits)
        assert (err.value.status, err.value.param) == (400, param) and quoted in err.value.message, err.value.message
    job = parse_completion({"prompt": [1, 2], "max_tokens": 5, "max_completion_tokens": 5, "stop": ["z" * 256]},
                           Untouchable(), limits)
    assert job.max_tokens == 5 and job.stop == ["z" * 256]
    assert parse_completion({"prompt": [1], "max_completion_tokens": 7}, Untouchable(), limits).max_tokens == 7
    many = [{"role": "user", "content": ""}] * 65
    with pytest.raises(APIError) as err:
        parse_chat({"messages": many}, Untouchable(), limits)
    assert err.value.param == "messages" and "65 messages" in err.value.message
    with pytest.raises(APIError) as err:
        parse_chat({"messages": [{"role": "user", "content": "x", "name": 3}]}, Untouchable(), limits)
    assert err.value.param == "messages[0].name" and "got 3" in err.value.message
    named = [{"role": "user", "content": "hi", "name": "ada"}, {"role": "assistant", "content": "yes"}]
    assert fallback_chat_prompt(named) == "user (ada): hi\nassistant: yes\nassistant:"


def test_the_collector_pause_holds_the_collector_off_until_the_last_holder_leaves():
    from moeprefetch.serve.guards import CollectorPause

    pause = CollectorPause()
    assert gc.isenabled()
    try:
        with pause:
            assert not gc.isenabled()
            with pause:  # a second parse worker
                assert not gc.isenabled()
            assert not gc.isenabled()
        assert gc.isenabled()
        gc.disable()  # a process that runs without the collector keeps it off
        with pause:
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_bodies_are_decoded_with_the_collector_held_off(live, monkeypatch):
    import moeprefetch.serve.app as app_module

    seen = []
    real = app_module.decode_body
    monkeypatch.setattr(app_module, "decode_body", lambda raw: (seen.append(gc.isenabled()), real(raw))[1])
    many = json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 1, "pad": [[]] * 50_000})
    response = httpx.post(live.url + "/v1/completions", timeout=30, content=many,
                          headers={"Content-Type": "application/json"})
    _error_of(response, 400, "pad")
    assert seen == [False] and gc.isenabled()


@pytest.mark.parametrize("raw", [b"GARBAGE\r\n\r\n", b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                 b"Content-Length: abc\r\n\r\n",
                                 b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n"
                                 b"Content-Type: application/json\r\n\r\nzz\r\n"])
def test_what_is_not_http_gets_a_json_400_and_the_server_carries_on(live, raw):
    with socket.create_connection(("127.0.0.1", live.port), timeout=10) as sock:
        sock.sendall(raw)
        reply = _read_reply(sock)
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"content-type: application/json" in head.lower(), reply
    error = json.loads(body)["error"]
    assert "not valid HTTP/1.1" in error["message"] and error["code"] == "bad_request"
    assert httpx.get(live.url + "/health", timeout=10).status_code == 200
