"""The Batch API's runner and the server's engine, in process: expiry, a dead engine, a failing
receiver, synced uploads, and a state folder that belongs to one model."""

import io
import json
import logging
import time

import pytest

from colibri.convert.hf_to_colibri import ConvertOptions, convert
from colibri.convert.synthetic import write_checkpoint
from colibri.runtime import open_model

pytest.importorskip("starlette", reason="the serve extra installs starlette")

from colibri.cli.server.app import Server  # noqa: E402
from colibri.cli.server.batch_store import WINDOW_SECONDS, BatchStore, StateError  # noqa: E402
from colibri.cli.server.batches import BatchAPI, BatchRunner, parse_requests  # noqa: E402
from colibri.cli.server.engine_thread import Engine, Request  # noqa: E402
from colibri.cli.server.openai_api import APIError  # noqa: E402

ENDPOINT = "/v1/completions"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("batch-api")
    convert(str(write_checkpoint(root / "src", "qwen3_moe")), root / "tiny", ConvertOptions(quant="Q4_K_M", progress=False))
    return root / "tiny"


@pytest.fixture
def model(model_dir):
    model = open_model(model_dir, parallel=2, ctx=256, ram_budget=4 << 30)
    yield model
    model.close()


class Clock:
    def __init__(self):
        self.now = 1_000_000.0

    def __call__(self):
        return self.now


def requests_of(n, max_tokens):
    lines = [{"custom_id": f"req-{i}", "method": "POST", "url": ENDPOINT,
              "body": {"model": "tiny", "prompt": f"Document {i}: the mill", "max_tokens": max_tokens,
                       "temperature": 0}} for i in range(n)]
    requests, errors = parse_requests("".join(json.dumps(line) + "\n" for line in lines).encode(), ENDPOINT)
    assert not errors
    return requests


def wait_until(condition, seconds=120):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.01)
    raise AssertionError("timed out")


def rows(store, file_id):
    return [json.loads(line) for line in store.file_path(file_id).read_text().splitlines()] if file_id else []


def test_a_batch_past_its_window_expires_and_its_unanswered_requests_go_to_the_error_file(model, tmp_path):
    clock = Clock()
    store = BatchStore(tmp_path, "tiny", clock)
    server = Server(model, "tiny")
    runner = BatchRunner(store, server)
    try:
        batch = store.create_batch("file_in", ENDPOINT, "24h", None, requests_of(8, max_tokens=60), [])
        assert batch["expires_at"] == batch["created_at"] + WINDOW_SECONDS["24h"]
        wait_until(lambda: store.batch(batch["id"])["request_counts"]["completed"] >= 1)
        clock.now += WINDOW_SECONDS["24h"]
        wait_until(lambda: store.batch(batch["id"])["status"] == "expired")
    finally:
        runner.close()
        server.close()
    done = store.batch(batch["id"])
    answered, unanswered = rows(store, done["output_file_id"]), rows(store, done["error_file_id"])
    assert done["expired_at"] == int(clock.now) and len(answered) >= 1 and unanswered
    assert sorted(r["custom_id"] for r in answered + unanswered) == sorted(f"req-{i}" for i in range(8))
    assert all(r["response"] is None and r["error"]["code"] == "batch_expired" for r in unanswered)
    assert done["request_counts"] == {"total": 8, "completed": len(answered), "failed": len(unanswered)}
    assert not server.engine.by_sequence and not server.engine.scheduler.running  # the cancelled ones freed


def test_a_dead_engine_fails_the_open_batches_with_its_cause(model, tmp_path, caplog):
    store = BatchStore(tmp_path, "tiny")
    server = Server(model, "tiny")
    runner = BatchRunner(store, server)
    steps, step = [0], server.engine.scheduler.step

    def failing_step():
        steps[0] += 1
        if steps[0] > 3:
            raise OSError("reading experts: the disk is gone")
        return step()

    server.engine.scheduler.step = failing_step
    with caplog.at_level(logging.ERROR, "colibri.serve"):
        batch = store.create_batch("file_in", ENDPOINT, "24h", None, requests_of(6, max_tokens=40), [])
        runner.thread.join(timeout=120)
    assert not runner.thread.is_alive(), "the runner kept retrying on a dead engine"
    failed = store.batch(batch["id"])
    assert failed["status"] == "failed" and failed["failed_at"] is not None
    assert [e["code"] for e in failed["errors"]["data"]] == ["engine_failed"]
    assert "the disk is gone" in failed["errors"]["data"][0]["message"]
    unanswered = rows(store, failed["error_file_id"])
    assert len(unanswered) == 6 and all("the disk is gone" in r["error"]["message"] for r in unanswered)
    assert any("the disk is gone" in r.getMessage() for r in caplog.records)
    server.close()


def test_a_receiver_that_raises_is_logged_and_its_sequence_cancelled(model, caplog):
    engine = Engine(model)
    try:
        def broken(event):
            raise ConnectionResetError("the client went away")

        tokens = model.tokenizer.encode("The river town")
        with caplog.at_level(logging.WARNING, "colibri.serve"):
            dropped = engine.submit(Request(tokens, {"max_tokens": 50, "temperature": 0}, broken))
            assert dropped.done.wait(60)
        assert dropped.cancel_reason == "its receiver failed: ConnectionResetError: the client went away"
        assert [r.getMessage() for r in caplog.records] == [f"request cancelled: {dropped.cancel_reason}"]
        events = []
        after = engine.submit(Request(tokens, {"max_tokens": 5, "temperature": 0}, events.append))
        assert after.done.wait(60) and events[-1].finish_reason in ("stop", "length")  # the engine carries on
        assert engine.failure is None and not engine.by_sequence
    finally:
        engine.close()


def test_an_upload_is_synced_before_it_is_recorded_and_one_too_large_leaves_nothing(tmp_path, monkeypatch):
    store = BatchStore(tmp_path, "tiny")
    synced = []
    monkeypatch.setattr("colibri.cli.server.batch_store.os.fsync", synced.append)
    api = BatchAPI(store, runner=None, max_upload=3 << 20)
    data = b'{"x": 1}\n' * 300_000
    assert api._store_upload(io.BytesIO(data), "file_a") == len(data) and len(synced) == 1
    assert store.file_path("file_a").read_bytes() == data
    with pytest.raises(APIError, match="--max-upload"):
        api._store_upload(io.BytesIO(data * 2), "file_b")
    assert sorted(p.name for p in store.files_dir.iterdir()) == ["file_a"]


def test_a_state_folder_belongs_to_one_model(tmp_path):
    BatchStore(tmp_path, "tiny-0123")
    with pytest.raises(StateError) as refused:
        BatchStore(tmp_path, "other-4567")
    assert str(refused.value) == (f"{tmp_path} holds the Batch API state of another model (tiny-0123); "
                                  "give this one its own --state-dir")
    BatchStore(tmp_path, "tiny-0123")  # the same model comes back to its state
