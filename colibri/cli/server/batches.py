"""OpenAI's Batch API: `/v1/files` and `/v1/batches`, run on the engine's idle slots.

A batch's requests are checked when it is created (one JSON object a line: `custom_id`,
`method` POST, `url` the batch's endpoint, `body`); the runner thread then feeds them to the
engine as batch requests (admitted only into slots no interactive request waits for), records
each answer in the `BatchStore` as it finishes, and writes the output and error files in
OpenAI's format when the batch ends. After a restart, open batches carry on from their
unanswered requests.
"""

from __future__ import annotations

import json
import logging
import threading

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request as HTTPRequest
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route

from colibri.formats.safe_json import loads
from colibri.cli.server import openai_api
from colibri.cli.server.app import read_json
from colibri.cli.server.batch_store import BatchStore, new_id
from colibri.cli.server.engine_thread import Request
from colibri.cli.server.openai_api import APIError

ENDPOINTS = {"/v1/chat/completions": True, "/v1/completions": False}  # endpoint -> chat
MAX_REQUESTS = 50_000  # per batch, as OpenAI
POLL_SECONDS = 0.05


class BatchRunner:
    """Feeds open batches' requests to the engine, at most two per slot in flight."""

    def __init__(self, store: BatchStore, server):
        self.store, self.server = store, server
        self.in_flight: dict[tuple[str, int], Request] = {}
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.stopping = False
        self.thread = threading.Thread(target=self._run, name="colibri-batches", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.stopping = True
        self.wake.set()
        self.thread.join()

    def _run(self) -> None:
        while not self.stopping:
            try:
                for batch_id in self.store.open_batches():
                    self._advance(batch_id)
            except Exception:  # noqa: BLE001 - a dead engine fails the open batches; anything else is retried
                failure = self.server.engine.failure
                if failure is not None:
                    self._fail_open_batches(f"the engine stopped: {type(failure).__name__}: {failure}")
                    return
                logging.getLogger("colibri.serve").exception("batch runner")
                self.wake.wait(1.0)
            self.wake.wait(POLL_SECONDS)
            self.wake.clear()

    def _advance(self, batch_id: str) -> None:
        batch = self.store.batch(batch_id)
        with self.lock:
            mine = {line: r for (b, line), r in self.in_flight.items() if b == batch_id}
        expired = batch["expires_at"] is not None and self.store.clock() >= batch["expires_at"]
        if batch["status"] == "cancelling" or expired:
            for request in mine.values():
                self.server.engine.cancel(request)
            if mine:
                return
            if batch["status"] == "cancelling":
                self._finish(batch_id, "cancelled")
            else:
                self._finish(batch_id, "expired", ("batch_expired", "This request could not be executed before the "
                                                                     "completion window expired."))
            return
        pending = [p for p in self.store.pending(batch_id) if p[0] not in mine]
        if not pending and not mine:
            self._finish(batch_id, "completed")
            return
        room = 2 * len(self.server.model.slots) - len(self.in_flight)
        for line, custom_id, body in pending[:max(room, 0)]:
            self._submit(batch_id, line, custom_id, loads(body, "request body", ValueError), ENDPOINTS[batch["endpoint"]])

    def _submit(self, batch_id: str, line: int, custom_id: str, body: dict, chat: bool) -> None:
        request_id = new_id("req")
        try:
            job = openai_api.make_job({**body, "stream": False}, chat, self.server.model, self.server.name)
        except APIError as e:
            self.store.answer(batch_id, line, False, _line(custom_id, request_id, e.status, e.body()))
            return
        pieces = []

        def on_event(event):
            if isinstance(event, BaseException) or event.finish_reason == "cancelled":
                self._forget(batch_id, line)  # not answered: a later pass (or a restart) runs it again
                return
            pieces.append(event.text)
            if event.finish_reason is None:
                return
            body = openai_api.response(job, self.server.name, "".join(pieces), event.finish_reason,
                                       event.numbers["generated_tokens"])
            self.store.answer(batch_id, line, True, _line(custom_id, request_id, 200, body))
            self._forget(batch_id, line)
            self.wake.set()

        request = Request(job.prompt, job.sampling, on_event, interactive=False)
        with self.lock:
            self.in_flight[batch_id, line] = request
        self.server.engine.submit(request)

    def _forget(self, batch_id: str, line: int) -> None:
        with self.lock:
            self.in_flight.pop((batch_id, line), None)

    def _finish(self, batch_id: str, status: str, unanswered: tuple[str, str] | None = None, **columns) -> None:
        """Write the output and error files from the recorded answers, then end the batch.
        `unanswered` (code, message): the error each request still pending gets."""
        self.store.set_status(batch_id, "finalizing")
        if unanswered is not None:
            code, message = unanswered
            self.store.answer_all(batch_id, [(line, _error_line(custom_id, code, message))
                                             for line, custom_id, _ in self.store.pending(batch_id)], ok=False)
        files = {}
        for kind, rows in (("output_file_id", self.store.results(batch_id, "done")),
                           ("error_file_id", self.store.results(batch_id, "failed"))):
            if rows:
                data = "".join(r + "\n" for r in rows).encode()
                files[kind] = self.store.write_file("batch_output", f"{batch_id}_{kind[:-8]}.jsonl", data)
        self.store.set_status(batch_id, status, **files, **columns)

    def _fail_open_batches(self, cause: str) -> None:
        """The engine is gone: every open batch fails, its unanswered requests naming `cause`."""
        log = logging.getLogger("colibri.serve")
        for batch_id in self.store.open_batches():
            log.error("batch %s failed: %s", batch_id, cause)
            errors = {"object": "list", "data": [{"code": "engine_failed", "message": cause, "param": None, "line": None}]}
            self._finish(batch_id, "failed", ("engine_failed", cause), errors=json.dumps(errors))


def _line(custom_id: str, request_id: str, status_code: int, body: dict) -> dict:
    return {"id": new_id("batch_req"), "custom_id": custom_id,
            "response": {"status_code": status_code, "request_id": request_id, "body": body}, "error": None}


def _error_line(custom_id: str, code: str, message: str) -> dict:
    """An error-file line for a request that got no response, as OpenAI writes one."""
    return {"id": new_id("batch_req"), "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}


def parse_requests(data: bytes, endpoint: str) -> tuple[list[tuple[str, str]], list[dict]]:
    """(custom_id, body JSON) of each line of a batch input, and OpenAI-style errors."""
    requests, errors, seen = [], [], set()

    def error(line: int, code: str, message: str) -> None:
        errors.append({"code": code, "message": message, "param": None, "line": line})

    lines = data.split(b"\n")
    if lines and not lines[-1].strip():
        lines.pop()
    if len(lines) > MAX_REQUESTS:
        error(None, "too_many_requests", f"a batch holds at most {MAX_REQUESTS} requests, this file {len(lines)}")
        return [], errors
    for number, raw in enumerate(lines, 1):
        try:
            item = loads(raw, f"line {number}", ValueError)
        except ValueError as e:
            error(number, "invalid_json_line", str(e))
            continue
        if not isinstance(item, dict):
            error(number, "invalid_request", f"line {number}: not a JSON object")
            continue
        custom_id, body = item.get("custom_id"), item.get("body")
        if not isinstance(custom_id, str) or not custom_id:
            error(number, "missing_required_parameter", f"line {number}: 'custom_id' must be a non-empty string")
        elif custom_id in seen:
            error(number, "duplicate_custom_id", f"line {number}: custom_id {custom_id!r} is used twice")
        elif item.get("method") != "POST":
            error(number, "invalid_method", f"line {number}: 'method' must be POST")
        elif item.get("url") != endpoint:
            error(number, "mismatched_url", f"line {number}: 'url' must be the batch's endpoint {endpoint}")
        elif not isinstance(body, dict):
            error(number, "invalid_request", f"line {number}: 'body' must be an object")
        else:
            seen.add(custom_id)
            requests.append((custom_id, json.dumps(body)))
    if not requests and not errors:
        error(None, "empty_file", "the input file holds no requests")
    return requests, errors


class BatchAPI:
    def __init__(self, store: BatchStore, runner: BatchRunner, max_upload: int):
        self.store, self.runner, self.max_upload = store, runner, max_upload

    def routes(self) -> list[Route]:
        return [Route("/v1/files", self.upload, methods=["POST"]),
                Route("/v1/files/{file_id}", self.get_file),
                Route("/v1/files/{file_id}/content", self.file_content),
                Route("/v1/batches", self.create, methods=["POST"]),
                Route("/v1/batches", self.list),
                Route("/v1/batches/{batch_id}", self.get_batch),
                Route("/v1/batches/{batch_id}/cancel", self.cancel, methods=["POST"])]

    async def upload(self, request: HTTPRequest) -> Response:
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_upload + (1 << 20)):
            raise APIError(413, f"upload over {self.max_upload} bytes (--max-upload)", "file", "file_too_large")
        async with request.form(max_files=1, max_fields=8) as form:
            upload, purpose = form.get("file"), form.get("purpose")
            if purpose != "batch":
                raise APIError(400, "only purpose 'batch' is supported", "purpose")
            if upload is None or isinstance(upload, str):
                raise APIError(400, "'file' must be an uploaded file", "file")
            file_id = new_id("file")
            size = await run_in_threadpool(self._store_upload, upload.file, file_id)
            name = (upload.filename or "upload.jsonl").replace("/", "_")[:255]
        return JSONResponse(self.store.add_file(file_id, purpose, name, size))

    def _store_upload(self, source, file_id: str) -> int:
        def chunks():
            size = 0
            while part := source.read(1 << 20):
                size += len(part)
                if size > self.max_upload:
                    raise APIError(413, f"upload over {self.max_upload} bytes (--max-upload)", "file", "file_too_large")
                yield part

        return self.store.save(file_id, chunks())

    def _file(self, file_id: str) -> dict:
        found = self.store.file(file_id)
        if found is None:
            raise APIError(404, f"No such File object: {file_id}", "file_id", "not_found")
        return found

    async def get_file(self, request: HTTPRequest) -> Response:
        return JSONResponse(self._file(request.path_params["file_id"]))

    async def file_content(self, request: HTTPRequest) -> Response:
        found = self._file(request.path_params["file_id"])
        return FileResponse(self.store.file_path(found["id"]), media_type="application/jsonl")

    async def create(self, request: HTTPRequest) -> Response:
        try:
            body = await read_json(request)
        except ValueError as e:
            raise APIError(400, f"malformed JSON: {e}") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        endpoint, window = body.get("endpoint"), body.get("completion_window", "24h")
        if endpoint not in ENDPOINTS:
            raise APIError(400, f"'endpoint' must be one of {', '.join(ENDPOINTS)}", "endpoint")
        if window != "24h":
            raise APIError(400, "'completion_window' must be '24h'", "completion_window")
        metadata = body.get("metadata")
        if metadata is not None and not (isinstance(metadata, dict) and len(metadata) <= 16
                                         and all(isinstance(v, str) for v in metadata.values())):
            raise APIError(400, "'metadata' must be an object of at most 16 strings", "metadata")
        found = self._file(str(body.get("input_file_id")))
        if found["purpose"] != "batch":
            raise APIError(400, "the input file's purpose is not 'batch'", "input_file_id")
        data = await run_in_threadpool(self.store.file_path(found["id"]).read_bytes)
        requests, errors = await run_in_threadpool(parse_requests, data, endpoint)
        batch = self.store.create_batch(found["id"], endpoint, window, metadata, requests, errors)
        self.runner.wake.set()
        return JSONResponse(batch)

    async def list(self, request: HTTPRequest) -> Response:
        limit = request.query_params.get("limit", "20")
        if not limit.isdigit() or not 1 <= int(limit) <= 100:
            raise APIError(400, "'limit' must be an integer 1..100", "limit")
        page = self.store.batches(int(limit) + 1, request.query_params.get("after"))
        data = page[:int(limit)]
        return JSONResponse({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                             "last_id": data[-1]["id"] if data else None, "has_more": len(page) > int(limit)})

    def _batch(self, batch_id: str) -> dict:
        found = self.store.batch(batch_id)
        if found is None:
            raise APIError(404, f"No such Batch object: {batch_id}", "batch_id", "not_found")
        return found

    async def get_batch(self, request: HTTPRequest) -> Response:
        return JSONResponse(self._batch(request.path_params["batch_id"]))

    async def cancel(self, request: HTTPRequest) -> Response:
        batch = self._batch(request.path_params["batch_id"])
        if batch["status"] in ("validating", "in_progress"):
            self.store.set_status(batch["id"], "cancelling")
            self.runner.wake.set()
        elif batch["status"] != "cancelling":
            raise APIError(409, f"Cannot cancel a batch with status '{batch['status']}'", code="invalid_state")
        return JSONResponse(self._batch(batch["id"]))
