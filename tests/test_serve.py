"""`colibri serve` end to end: the official `openai` client against a server on 127.0.0.1."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from colibri.convert.hf_to_colibri import ConvertOptions, convert
from colibri.convert.synthetic import write_checkpoint

openai = pytest.importorskip("openai", reason="the test extra installs the openai client")
pytest.importorskip("starlette", reason="the serve extra installs starlette and uvicorn")

KEY = "test-key-123"
PROMPTS = ["The river town", "Once upon a time there was", "Bread, bells and", "A"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    convert(str(write_checkpoint(root / "src", "qwen3_moe")), root / "tiny", ConvertOptions(quant="Q4_K_M", progress=False))
    return root / "tiny"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(model, *extra):
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "colibri.cli", "serve", "--model", str(model), "--port", str(port),
                                "--parallel", "3", "--ctx", "256", "--ram-budget", "4G", *extra],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                if r.status == 200:
                    return process, f"http://127.0.0.1:{port}"
        except OSError:
            if process.poll() is not None:
                raise RuntimeError(process.stderr.read().decode())
            time.sleep(0.1)
    process.kill()
    raise RuntimeError("the server did not come up")


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    process, url = start(model, "--api-key", KEY, "--state-dir", str(tmp_path_factory.mktemp("serve-state")),
                         "--max-upload", "64K")
    yield url
    process.send_signal(signal.SIGINT)
    process.wait(timeout=30)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0)


def metrics(url) -> dict:
    request = urllib.request.Request(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request) as r:
        lines = r.read().decode().splitlines()
    return {line.split()[0]: float(line.split()[1]) for line in lines if line.startswith("colibri_")}


def batch_job_answers(model, tmp_path, prompts, max_tokens):
    """What `colibri run --prompt-dir` answers, greedy, for each prompt (text or messages)."""
    inputs, outputs = tmp_path / "in", tmp_path / "out"
    inputs.mkdir()
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            (inputs / f"{i}.txt").write_text(p)
        else:
            (inputs / f"{i}.json").write_text(json.dumps({"messages": p}))
    subprocess.run([sys.executable, "-m", "colibri.cli", "run", "--model", str(model), "--prompt-dir", str(inputs),
                    "--out-dir", str(outputs), "--max-tokens", str(max_tokens), "--ctx", "256", "--parallel", "2",
                    "--ram-budget", "4G"], check=True, capture_output=True)
    return [next(outputs.glob(f"{i}.*.out")).read_text() for i in range(len(prompts))]


def test_completions_and_chat_equal_the_batch_job_greedy(client, model, tmp_path):
    chats = [[{"role": "user", "content": p}] for p in PROMPTS[:2]]
    want = batch_job_answers(model, tmp_path, PROMPTS + chats, 12)
    results = [None] * (len(PROMPTS) + len(chats))

    def complete(i):  # all at once, from threads: they share the engine's steps
        if i < len(PROMPTS):
            r = client.completions.create(model="tiny", prompt=PROMPTS[i], max_tokens=12, temperature=0)
            results[i] = r.choices[0].text, r
        else:
            r = client.chat.completions.create(model="tiny", messages=chats[i - len(PROMPTS)], max_tokens=12,
                                               temperature=0)
            results[i] = r.choices[0].message.content, r

    threads = [threading.Thread(target=complete, args=(i,)) for i in range(len(results))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [text for text, _ in results] == want
    for _, r in results:
        assert r.usage.completion_tokens <= 12 and r.usage.prompt_tokens > 0
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
        assert r.choices[0].finish_reason in ("stop", "length") and r.model == "tiny"


def test_streaming_chat_gives_the_same_text_in_chunks(client):
    messages = [{"role": "user", "content": "Tell me about the mill"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0, seed=1)
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0, seed=1,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens and not chunks[-1].choices


def test_a_stop_string_and_seeded_sampling(client):
    free = client.completions.create(model="tiny", prompt="The river town", max_tokens=20, temperature=0).choices[0].text
    stop = free[3:5]
    cut = client.completions.create(model="tiny", prompt="The river town", max_tokens=20, temperature=0, stop=[stop])
    assert cut.choices[0].text == free[:free.index(stop)] and cut.choices[0].finish_reason == "stop"
    draws = [client.completions.create(model="tiny", prompt="A", max_tokens=10, temperature=0.9, seed=7).choices[0].text
             for _ in range(2)]
    assert draws[0] == draws[1]


def test_bad_requests_get_openai_errors(client, server):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="other", prompt="x")
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="word " * 2000)
    assert e.value.body["code"] == "context_length_exceeded"
    for bad in ({"temperature": 5}, {"top_p": 0}, {"max_tokens": 0}, {"n": 2}, {"stop": ["a"] * 5}):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="tiny", prompt="x", **bad)
        assert e.value.body["param"] in bad
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server + "/v1", api_key="wrong", max_retries=0).models.list()
    raw = urllib.request.Request(server + "/v1/completions", data=b"{not json", method="POST",
                                 headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(raw)
    assert e.value.code == 400 and "malformed JSON" in json.loads(e.value.read())["error"]["message"]
    host, port = server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:  # a declared 33 MB body: refused before it is sent
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
                  f"Content-Length: {33 << 20}\r\n\r\n".encode())
        assert s.recv(4096).startswith(b"HTTP/1.1 413")
    assert [m.id for m in client.models.list().data] == ["tiny"]
    with pytest.raises(openai.APIStatusError) as e:  # over --max-upload
        client.files.create(file=("big.jsonl", b"x" * (65 << 10)), purpose="batch")
    assert e.value.status_code == 413 and e.value.body["code"] == "file_too_large"
    with pytest.raises(openai.BadRequestError):
        client.files.create(file=("a.jsonl", b"{}"), purpose="fine-tune")


def test_a_client_that_leaves_mid_stream_frees_its_slot(client, server):
    before = metrics(server)["colibri_generated_tokens_total"]
    stream = client.completions.create(model="tiny", prompt="The river", max_tokens=200, temperature=0, stream=True)
    next(iter(stream))
    stream.close()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and metrics(server)["colibri_active_sequences"] > 0:
        time.sleep(0.05)
    numbers = metrics(server)
    assert numbers["colibri_active_sequences"] == 0 and numbers["colibri_queue_depth"] == 0
    assert numbers["colibri_generated_tokens_total"] - before < 200  # the 200-token request did not run to the end


def batch_input(n, max_tokens=10):
    lines = [{"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "tiny", "messages": [{"role": "user", "content": f"Document {i}: the mill"}],
                       "max_tokens": max_tokens, "temperature": 0}} for i in range(n)]
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def wait_for(client, batch_id, statuses, seconds=240):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        time.sleep(0.1)
    raise AssertionError(f"batch still {batch.status}")


def outputs(client, batch):
    lines = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
    return {line["custom_id"]: line["response"]["body"]["choices"][0]["message"]["content"] for line in lines}, lines


def test_a_batch_of_20_requests_uploaded_run_and_downloaded(client):
    uploaded = client.files.create(file=("in.jsonl", batch_input(20)), purpose="batch")
    assert client.files.retrieve(uploaded.id).bytes == len(batch_input(20))
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    done = wait_for(client, batch.id, ("completed", "failed"))
    assert done.status == "completed" and done.request_counts.completed == 20 and done.request_counts.failed == 0
    answers, lines = outputs(client, done)
    assert sorted(answers) == sorted(f"req-{i}" for i in range(20)) and len(lines) == 20
    alone = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Document 7: the mill"}],
                                           max_tokens=10, temperature=0)
    assert answers["req-7"] == alone.choices[0].message.content  # batched, the same bits as alone
    assert batch.id in [b.id for b in client.batches.list(limit=100).data]


def test_a_batch_with_bad_lines_fails_naming_them_and_cancel_stops_one(client):
    bad = batch_input(2) + b'{"custom_id": "req-0", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n{oops\n'
    uploaded = client.files.create(file=("bad.jsonl", bad), purpose="batch")
    failed = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert failed.status == "failed" and {e.code for e in failed.errors.data} == {"duplicate_custom_id", "invalid_json_line"}
    long = client.files.create(file=("long.jsonl", batch_input(40, max_tokens=200)), purpose="batch")
    batch = client.batches.create(input_file_id=long.id, endpoint="/v1/chat/completions", completion_window="24h")
    client.batches.cancel(batch.id)
    cancelled = wait_for(client, batch.id, ("cancelled",))
    assert cancelled.request_counts.completed < 40
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")


def test_a_server_killed_mid_batch_finishes_it_after_a_restart(model, tmp_path):
    state = tmp_path / "state"
    process, url = start(model, "--state-dir", str(state))
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    uploaded = client.files.create(file=("in.jsonl", batch_input(20, max_tokens=40)), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and client.batches.retrieve(batch.id).request_counts.completed < 3:
        time.sleep(0.02)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    process, url = start(model, "--state-dir", str(state))
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        before = client.batches.retrieve(batch.id)
        assert 3 <= before.request_counts.completed < 20, "the server was not killed mid-batch"
        done = wait_for(client, batch.id, ("completed",))
        answers, lines = outputs(client, done)
        assert len(lines) == 20 and sorted(answers) == sorted(f"req-{i}" for i in range(20))  # each exactly once
        alone = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Document 0: the mill"}],
                                               max_tokens=40, temperature=0)
        assert answers["req-0"] == alone.choices[0].message.content
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=30)


def test_an_interactive_request_is_not_kept_waiting_by_a_long_batch(client):
    """Every slot busy with 250-token batch requests: a chat request preempts one and is
    answered before any batch request ends; the batch still completes, each custom_id once."""
    long = client.files.create(file=("busy.jsonl", batch_input(6, max_tokens=250)), purpose="batch")
    batch = client.batches.create(input_file_id=long.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and metrics_open(client)["colibri_active_sequences"] < 3:
        time.sleep(0.005)
    reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "quick"}], max_tokens=3,
                                           temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert client.batches.retrieve(batch.id).request_counts.completed == 0
    done = wait_for(client, batch.id, ("completed",))
    answers, lines = outputs(client, done)
    assert len(lines) == 6 and sorted(answers) == sorted(f"req-{i}" for i in range(6))


def metrics_open(client):
    return metrics(str(client.base_url).removesuffix("/v1/"))


def test_the_live_page_and_its_numbers(client, server):
    client.completions.create(model="tiny", prompt="The live page", max_tokens=5, temperature=0)
    with urllib.request.urlopen(server + "/") as r:  # the page itself holds no data: no key needed
        page = r.read().decode()
    assert 'id="heat-box"' in page and 'id="history"' in page and "/live.json" in page and "/v1/batches" in page
    for outside in ("http://", "https://", "<link", "src="):
        assert outside not in page
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(server + "/live.json")
    assert refused.value.code == 401
    request = urllib.request.Request(server + "/live.json", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request) as r:
        live = json.loads(r.read())
    counts = live["heat"]["counts"]
    assert live["slots"] == 3 and live["generated_tokens"] >= 5 and live["heat"]["layers"]
    assert len(counts) == len(live["heat"]["layers"]) and sum(map(sum, counts)) > 0
    heat = live["charts"]["heat"]  # drawn by the server: a cell per expert chosen, a colour scale
    assert heat.count("<title>layer ") == sum(1 for row in counts for n in row if n)
    assert 'class="colour-scale"' in heat and f"<title>{max(map(max, counts))} choices</title>" in heat
    assert [chart.split('"', 2)[1] for chart in live["charts"]["history"]] == [
        "history-rate", "history-hits", "history-read"]
