"""serve/: a live server on localhost (uvicorn in a thread, or `moeprefetch serve` in a process) driven by the
official `openai` client: answers equal `engine.generate`, streaming equals non-streaming, concurrent clients get
their single-request answers, bad requests get OpenAI-style errors, disconnects free rows, a full queue answers 429,
an engine error fails one request only, a bounded load test loses nothing, SIGTERM drains."""

from __future__ import annotations

import json
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


class LiveServer:
    def __init__(self, path: Path, max_batch_size: int = 4, max_queue: int = 32, name: str = "tiny"):
        import uvicorn

        from moeprefetch.serve.app import build_app

        self.engine = MoEPrefetchEngine.from_pretrained(path, max_batch_size=max_batch_size, **ENGINE)
        self.app = build_app(self.engine, name, max_queue=max_queue, drain_seconds=2.0, default_max_tokens=16)
        self.port = _free_port()
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
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


def test_chat_applies_the_template_and_a_model_without_one_is_a_clear_400(live, reference):
    from moeprefetch.serve.protocol import APIError, parse_chat

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the quick"}]
    chat = live.client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    templated = reference.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    templated = templated["input_ids"] if hasattr(templated, "keys") else templated
    assert chat.usage.prompt_tokens == len(templated)
    assert chat.choices[0].message.content == _alone(reference, list(templated), 8)[0]

    class NoTemplate:
        chat_template = None

    with pytest.raises(APIError) as err:
        parse_chat({"messages": messages}, NoTemplate(), "tiny", 16)
    assert err.value.status == 400 and "no chat template" in err.value.message


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
        (dict(model="tiny", prompt="x", stop=["a"] * 9), 400, "stop"),
        (dict(model="tiny", prompt=[3, 99999]), 400, None),
        (dict(model="tiny", prompt="x", max_tokens=10**6), 400, None),
        (dict(model="other", prompt="x"), 404, "model"),
        (dict(model="tiny", prompt="x", ignore_eos="yes"), 400, "ignore_eos"),
    ]
    for body, status, param in cases:
        response = httpx.post(live.url + "/v1/completions", json=body, timeout=30)
        assert response.status_code == status, (body, response.text)
        error = response.json()["error"]
        assert error["message"] and error["type"] and (param is None or error["param"] == param)
    response = httpx.post(live.url + "/v1/completions", content=b"{not json", timeout=30)
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
    # a stream that fails before its first token gets the HTTP error, not a 200 with an error event
    response = httpx.post(live.url + "/v1/completions", timeout=30,
                          json={"model": "tiny", "prompt": [3, 10**6], "max_tokens": 3, "stream": True})
    assert response.status_code == 400 and response.json()["error"]["message"]


def test_a_client_that_disconnects_frees_its_row(live, monkeypatch):
    # steps of at least 10 ms: the 200 tokens outlast the server's notice of the disconnect on any machine (on a busy
    # CI runner the tiny model once finished them first, and nothing was left to cancel)
    batch = live.scheduler.batch
    step = batch.step
    monkeypatch.setattr(batch, "step", lambda: (time.sleep(0.01), step())[1])
    with httpx.stream("POST", live.url + "/v1/completions", timeout=30,
                      json={"model": "tiny", "prompt": "the quick", "max_tokens": 200, "temperature": 0,
                            "ignore_eos": True, "stream": True}) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
    deadline = time.monotonic() + 20
    while live.scheduler.snapshot()["active"] and time.monotonic() < deadline:
        time.sleep(0.05)
    state = live.scheduler.snapshot()
    assert state["active"] == 0 and state["requests"]["cancelled"] >= 1
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


def test_stop_strings_end_the_text_before_them(live, reference):
    # a prompt whose answer alone is long enough to hold a stop string (a random model may end one at once)
    prompt, full = next((p, text) for p in PROMPTS if len(text := _alone(reference, p, 16)[0]) > 6)
    stop = full[3:5]
    answer = live.client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0, stop=stop)
    assert answer.choices[0].text == full[: full.find(stop)] and answer.choices[0].finish_reason == "stop"
    streamed = live.client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0,
                                              stop=[stop], stream=True)
    assert "".join(c.choices[0].text for c in streamed) == full[: full.find(stop)]


def test_an_engine_error_fails_that_request_only(live, monkeypatch):
    batch = live.scheduler.batch
    admit = batch.admit

    def failing(prompt, *args, **kwargs):
        if prompt[:2] == [7, 7]:
            raise RuntimeError("injected failure")
        return admit(prompt, *args, **kwargs)

    monkeypatch.setattr(batch, "admit", failing)
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(httpx.post, live.url + "/v1/completions", timeout=60,
                               json={"model": "tiny", "prompt": ids, "max_tokens": 6, "temperature": 0})
                   for ids in ([7, 7, 8], [3, 4, 5], [9, 10])]
        responses = [f.result() for f in futures]
    assert responses[0].status_code == 500 and "injected failure" in responses[0].json()["error"]["message"]
    assert [r.status_code for r in responses[1:]] == [200, 200]
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
        assert all(r.json()["choices"][0]["text"] is not None for r in responses if r.status_code == 200)
    finally:
        server.close()


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


def test_sigterm_drains_requests_in_flight_then_exits(model_dir):
    port = _free_port()
    command = [sys.executable, "-m", "moeprefetch", "serve", str(model_dir), "--port", str(port), "--cache-slots", "6",
               "--max-batch-size", "2", "--max-seq-len", "256", "--drain-seconds", "20", "--model-name", "tiny"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, process.stderr.read()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
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
