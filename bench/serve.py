"""Benchmark: concurrent streaming clients against `colibri serve` on loopback.

Starts the server on the model (a free port on 127.0.0.1), then --clients threads each stream
chat completions with the official `openai` client, one after another, for --seconds. Prints
the time to first token (p50 / p99), aggregate generated tok/s, errors, and the server's
active sequences and queue after the clients stop (a leaked slot would show there); writes
bench/out/serve.json.

    python bench/serve.py --model DIR [--clients 32] [--seconds 60] [--parallel 32] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import openai

BENCH = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(model: Path, parallel: int, ctx: int, state: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "colibri.cli", "serve", "--model", str(model), "--port", str(port),
                                "--parallel", str(parallel), "--ctx", str(ctx), "--state-dir", str(state)])
    url = f"http://127.0.0.1:{port}"
    for _ in range(1200):
        try:
            urllib.request.urlopen(url + "/health", timeout=1).close()
            return process, url
        except OSError:
            time.sleep(0.1)
    process.kill()
    raise SystemExit("the server did not come up")


def metrics(url: str) -> dict:
    with urllib.request.urlopen(url + "/metrics") as r:
        return {line.split()[0]: float(line.split()[1]) for line in r.read().decode().splitlines()
                if line.startswith("colibri_")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--parallel", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--ctx", type=int, default=512)
    args = parser.parse_args()

    state = BENCH / "out" / "serve-state"
    process, url = start(args.model, args.parallel, args.ctx, state)
    name = args.model.resolve().name
    first_token, tokens, errors = [], [0], []
    lock = threading.Lock()
    stop_at = time.monotonic() + args.seconds

    def client_loop(i: int) -> None:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
        n = 0
        while time.monotonic() < stop_at:
            started = time.perf_counter()
            try:
                stream = client.chat.completions.create(
                    model=name, messages=[{"role": "user", "content": f"Client {i}, request {n}: tell a story"}],
                    max_tokens=args.max_tokens, temperature=0.7, seed=i * 1000 + n, stream=True,
                    stream_options={"include_usage": True})
                seen_first = False
                for chunk in stream:
                    if not seen_first and chunk.choices and chunk.choices[0].delta.content:
                        with lock:
                            first_token.append(time.perf_counter() - started)
                        seen_first = True
                    if chunk.usage is not None:
                        with lock:
                            tokens[0] += chunk.usage.completion_tokens
            except Exception as e:  # noqa: BLE001 - counted and printed
                with lock:
                    errors.append(f"{type(e).__name__}: {e}")
            n += 1

    started = time.monotonic()
    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - started
    time.sleep(0.5)
    after = metrics(url)
    process.terminate()
    process.wait(timeout=60)
    ttft = np.array(first_token)
    result = {"date": time.strftime("%Y-%m-%d"), "clients": args.clients, "parallel": args.parallel,
              "seconds": elapsed, "requests": len(first_token), "errors": len(errors),
              "ttft_p50_s": float(np.percentile(ttft, 50)) if ttft.size else None,
              "ttft_p99_s": float(np.percentile(ttft, 99)) if ttft.size else None,
              "aggregate_tok_per_s": tokens[0] / elapsed,
              "active_after": after["colibri_active_sequences"], "queue_after": after["colibri_queue_depth"]}
    print(json.dumps(result, indent=1))
    for e in errors[:5]:
        print("error:", e)
    (BENCH / "out").mkdir(exist_ok=True)
    (BENCH / "out" / "serve.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
