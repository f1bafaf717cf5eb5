"""`colibri serve`: arguments, and the model and server they start."""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import sys
from pathlib import Path

from colibri.cli.isa_flag import add_isa_flag, settle_isa
from colibri.runtime.memory import size_argument
from colibri.runtime.options import MOST_PARALLEL, add_engine_flags, engine_options


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, metavar="DIR", help="a converted model folder")
    p.add_argument("--model-name", default=None, help="the name clients ask for (default: the folder's name)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s, this machine only)")
    p.add_argument("--port", type=int, default=8080, help="port (default: %(default)s)")
    p.add_argument("--api-key", default=os.environ.get("COLIBRI_API_KEY"), metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every route but /health (default: $COLIBRI_API_KEY, else none)")
    p.add_argument("--state-dir", type=Path, default=None, metavar="DIR",
                   help="the Batch API's uploaded files, results and SQLite state, of one model; a restarted server "
                        f"carries on its open batches (default: {STATE_ROOT}/NAME-DIGEST, the model's own)")
    p.add_argument("--max-upload", type=size_argument, default="2G", metavar="SIZE",
                   help="largest file /v1/files takes (default: %(default)s)")
    add_engine_flags(p)  # --parallel: the requests decoded together
    add_isa_flag(p)


STATE_ROOT = Path.home() / ".cache" / "colibri" / "serve"


def model_key(model_dir: Path) -> str:
    """What a Batch API state belongs to: the folder's name and its manifest's digest."""
    digest = hashlib.sha256((Path(model_dir) / "colibri.json").read_bytes()).hexdigest()[:16]
    return f"{Path(model_dir).resolve().name}-{digest}"


SERVE_EXTRA = "pip install 'colibri-moe[serve]'"
SERVE_MODULES = ("uvicorn", "starlette", "prometheus_client", "python_multipart")  # what the serve extra installs


def serve_command(args: argparse.Namespace) -> int:
    missing = [name for name in SERVE_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        raise SystemExit(f"colibri serve: error: the server needs {', '.join(missing)}: {SERVE_EXTRA}")
    settle_isa(args, "serve")
    import uvicorn

    from colibri.runtime import open_model
    from colibri.cli.server.app import Server, build_app
    from colibri.cli.server.batch_store import BatchStore, StateError
    from colibri.cli.server.batches import BatchAPI, BatchRunner

    model = open_model(args.model, engine_options(args, "serve"), jobs=MOST_PARALLEL)  # requests come without end
    key = model_key(args.model)
    try:
        store = BatchStore(args.state_dir or STATE_ROOT / key, key)
    except StateError as e:
        raise SystemExit(f"colibri serve: error: {e}") from None
    name = args.model_name or Path(args.model).resolve().name
    server = Server(model, name, args.api_key)
    runner = BatchRunner(store, server)
    batch_api = BatchAPI(store, runner, args.max_upload)
    print(f"colibri serve: {name} on http://{args.host}:{args.port}/v1 ({len(model.slots)} slots of {args.ctx} tokens)",
          file=sys.stderr, flush=True)
    uvicorn.run(build_app(server, batch_api.routes(), closers=[runner.close]), host=args.host, port=args.port,
                log_level="warning")
    model.close()
    return 0
