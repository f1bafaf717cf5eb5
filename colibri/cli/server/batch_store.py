"""The Batch API's state in SQLite: uploaded files, batches, and every request's result.

A request's result is committed (synchronous=FULL) the moment it is answered, and the output
file is written from those rows only when the batch ends, so a server killed at any moment
comes back knowing which requests are answered (never redone) and which are not (redone);
no `custom_id` is lost or written twice. Files are synced before they are recorded. A state
folder belongs to one model: opening it for another is refused.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
import uuid
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, purpose TEXT NOT NULL, filename TEXT NOT NULL, bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, input_file_id TEXT NOT NULL, endpoint TEXT NOT NULL, completion_window TEXT NOT NULL,
    status TEXT NOT NULL, created_at INTEGER NOT NULL, times TEXT NOT NULL, metadata TEXT,
    errors TEXT, output_file_id TEXT, error_file_id TEXT);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS requests (
    batch_id TEXT NOT NULL, line INTEGER NOT NULL, custom_id TEXT NOT NULL, body TEXT NOT NULL,
    status TEXT NOT NULL, result TEXT, PRIMARY KEY (batch_id, line));
"""
OPEN_STATUSES = ("validating", "in_progress", "finalizing", "cancelling")
TIME_FIELDS = ("in_progress_at", "expires_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
               "cancelling_at", "cancelled_at")
WINDOW_SECONDS = {"24h": 24 * 3600}  # completion_window -> seconds until the batch expires


class StateError(Exception):
    """A state folder that cannot serve this model."""


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class BatchStore:
    """`model` names what the state belongs to (`model_key`); `clock` gives the time in seconds."""

    def __init__(self, state_dir: Path, model: str, clock=time.time):
        self.dir, self.clock = Path(state_dir), clock
        self.files_dir = self.dir / "files"
        self.files_dir.mkdir(parents=True, exist_ok=True)
        for leftover in self.files_dir.glob("*.partial"):  # an upload cut off by a crash
            leftover.unlink()
        self.lock = threading.Lock()
        self.db = sqlite3.connect(self.dir / "state.sqlite3", check_same_thread=False, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.executescript(SCHEMA)
        self._claim(model)

    def _claim(self, model: str) -> None:
        self.db.execute("INSERT OR IGNORE INTO meta VALUES ('model', ?)", (model,))
        (owner,), = self.db.execute("SELECT value FROM meta WHERE key = 'model'").fetchall()
        if owner != model:
            self.db.close()
            raise StateError(f"{self.dir} holds the Batch API state of another model ({owner}); "
                             f"give this one its own --state-dir")

    def _rows(self, sql: str, args=()) -> list[tuple]:
        with self.lock:
            return self.db.execute(sql, args).fetchall()

    def _write(self, statements: list[tuple[str, tuple]]) -> None:
        """Statements in one transaction."""
        with self.lock:
            self.db.execute("BEGIN IMMEDIATE")
            try:
                for sql, args in statements:
                    self.db.execute(sql, args)
                self.db.execute("COMMIT")
            except BaseException:
                self.db.execute("ROLLBACK")
                raise

    # --- files ---------------------------------------------------------------------

    def file_path(self, file_id: str) -> Path:
        return self.files_dir / file_id

    def add_file(self, file_id: str, purpose: str, filename: str, size: int) -> dict:
        self._write([("INSERT INTO files VALUES (?, ?, ?, ?, ?)", (file_id, purpose, filename, size, int(self.clock())))])
        return self.file(file_id)

    def file(self, file_id: str) -> dict | None:
        rows = self._rows("SELECT id, purpose, filename, bytes, created_at FROM files WHERE id = ?", (file_id,))
        if not rows:
            return None
        fid, purpose, filename, size, created = rows[0]
        return {"id": fid, "object": "file", "bytes": size, "created_at": created, "filename": filename,
                "purpose": purpose, "status": "processed", "status_details": None}

    def save(self, file_id: str, chunks) -> int:
        """Write the byte strings of `chunks` as `file_id`, synced to disk; its size. If
        `chunks` raises, nothing is left behind."""
        partial, size = self.file_path(file_id).with_suffix(".partial"), 0
        try:
            with open(partial, "wb") as f:
                for chunk in chunks:
                    f.write(chunk)
                    size += len(chunk)
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
        partial.replace(self.file_path(file_id))
        return size

    def write_file(self, purpose: str, filename: str, data: bytes) -> str:
        """A file the server makes (a batch's output or errors), synced before it is recorded."""
        file_id = new_id("file")
        self.add_file(file_id, purpose, filename, self.save(file_id, [data]))
        return file_id

    # --- batches -------------------------------------------------------------------

    def create_batch(self, input_file_id: str, endpoint: str, window: str, metadata, requests: list[tuple[str, str]],
                     errors: list[dict]) -> dict:
        """A batch of (custom_id, body JSON) requests, in progress; or failed with `errors`."""
        batch_id, now = new_id("batch"), int(self.clock())
        status = "failed" if errors else "in_progress"
        times = {"in_progress_at": now, "expires_at": now + WINDOW_SECONDS[window]} if not errors else {"failed_at": now}
        statements = [("INSERT INTO batches VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, NULL, NULL)",
                       (batch_id, input_file_id, endpoint, window, status, now, json.dumps(times),
                        json.dumps(metadata) if metadata is not None else None,
                        json.dumps({"object": "list", "data": errors}) if errors else None))]
        if not errors:
            statements += [("INSERT INTO requests VALUES (?, ?, ?, ?, 'pending', NULL)", (batch_id, i, custom_id, body))
                           for i, (custom_id, body) in enumerate(requests)]
        self._write(statements)
        return self.batch(batch_id)

    def batch(self, batch_id: str) -> dict | None:
        rows = self._rows("SELECT id, input_file_id, endpoint, completion_window, status, created_at, times, metadata, "
                          "errors, output_file_id, error_file_id FROM batches WHERE id = ?", (batch_id,))
        if not rows:
            return None
        bid, input_file, endpoint, window, status, created, times, metadata, errors, output, error_file = rows[0]
        counts = dict(self._rows("SELECT status, COUNT(*) FROM requests WHERE batch_id = ? GROUP BY status", (bid,)))
        times = json.loads(times)
        return {"id": bid, "object": "batch", "endpoint": endpoint, "errors": json.loads(errors) if errors else None,
                "input_file_id": input_file, "completion_window": window, "status": status,
                "output_file_id": output, "error_file_id": error_file, "created_at": created,
                **{f: times.get(f) for f in TIME_FIELDS},
                "request_counts": {"total": sum(counts.values()), "completed": counts.get("done", 0),
                                   "failed": counts.get("failed", 0)},
                "metadata": json.loads(metadata) if metadata else None}

    def batches(self, limit: int, after: str | None) -> list[dict]:
        """Newest first, as OpenAI lists them; `after` an id of the previous page."""
        if after is not None:
            rows = self._rows("SELECT id FROM batches WHERE created_at < (SELECT created_at FROM batches WHERE id = ?) "
                              "OR (created_at = (SELECT created_at FROM batches WHERE id = ?) AND id < ?) "
                              "ORDER BY created_at DESC, id DESC LIMIT ?", (after, after, after, limit))
        else:
            rows = self._rows("SELECT id FROM batches ORDER BY created_at DESC, id DESC LIMIT ?", (limit,))
        return [self.batch(bid) for (bid,) in rows]

    def open_batches(self) -> list[str]:
        """Batches still to be worked on, oldest first."""
        marks = ",".join("?" * len(OPEN_STATUSES))
        return [bid for (bid,) in self._rows(f"SELECT id FROM batches WHERE status IN ({marks}) ORDER BY created_at, id",
                                             OPEN_STATUSES)]

    def status(self, batch_id: str) -> str:
        return self._rows("SELECT status FROM batches WHERE id = ?", (batch_id,))[0][0]

    def set_status(self, batch_id: str, status: str, **columns) -> None:
        times = json.loads(self._rows("SELECT times FROM batches WHERE id = ?", (batch_id,))[0][0])
        times[f"{status}_at"] = int(self.clock())
        sets = ", ".join(f"{c} = ?" for c in columns)
        self._write([(f"UPDATE batches SET status = ?, times = ?{', ' + sets if sets else ''} WHERE id = ?",
                      (status, json.dumps(times), *columns.values(), batch_id))])

    def pending(self, batch_id: str) -> list[tuple[int, str, str]]:
        """(line, custom_id, body) of the requests not answered yet, in line order."""
        return self._rows("SELECT line, custom_id, body FROM requests WHERE batch_id = ? AND status = 'pending' "
                          "ORDER BY line", (batch_id,))

    def answer(self, batch_id: str, line: int, ok: bool, result: dict) -> None:
        self.answer_all(batch_id, [(line, result)], ok)

    def answer_all(self, batch_id: str, answers: list[tuple[int, dict]], ok: bool) -> None:
        """Record (line, result) answers in one transaction; lines already answered keep theirs."""
        self._write([("UPDATE requests SET status = ?, result = ? WHERE batch_id = ? AND line = ? AND status = 'pending'",
                      ("done" if ok else "failed", json.dumps(result), batch_id, line)) for line, result in answers])

    def results(self, batch_id: str, status: str) -> list[str]:
        return [r for (r,) in self._rows("SELECT result FROM requests WHERE batch_id = ? AND status = ? ORDER BY line",
                                         (batch_id, status))]
