"""The README's screenshots, from a real run: `colibri report` of a folder job and the server's
live page, taken by headless Chromium (Debian: `apt install chromium`).

    .venv/bin/python docs/screenshots.py [--out docs] [--evidence DIR]

Converts the built-in tiny model, runs a `--prompt-dir` job with `--trace-routing` and
`--stats`, writes its report; then serves the model, sends three rounds of completions, and shoots the live
page. Writes OUT/report.png and OUT/live.png; with --evidence, also each page's DOM after its
scripts ran (*.dom.html), Chromium's console (*.console.txt) and the numbers the pages should
show (numbers.json), which tests/test_pages_render.py checks.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from colibri.cli import main as colibri
from colibri.convert.hf_to_colibri import ConvertOptions, convert
from colibri.convert.synthetic import write_checkpoint
from colibri.cli.report import build_report
from colibri.cli.server.live import SAMPLE_SECONDS

WINDOW = {"report": "1100,1500", "live": "1100,1000"}
DOCUMENTS = ("The mill by the river", "A letter about bread", "Notes on the bell tower", "The ferry timetable",
             "Minutes of the town meeting", "A recipe for rye", "The harvest report", "Songs of the valley")


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        sys.exit("docs/screenshots.py: headless Chromium not found (Debian: apt install chromium)")
    return found


def shoot(url: str, name: str, out: Path, evidence: Path) -> None:
    """OUT/NAME.png of `url`; EVIDENCE/NAME.dom.html (the DOM after 4 s of the page's time) and NAME.console.txt."""
    with tempfile.TemporaryDirectory() as profile:
        flags = [chromium(), "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 f"--user-data-dir={profile}", "--hide-scrollbars", "--virtual-time-budget=4000",
                 f"--window-size={WINDOW[name]}", "--enable-logging=stderr", "--v=0"]
        subprocess.run(flags + [f"--screenshot={out / (name + '.png')}", url], capture_output=True, timeout=120, check=True)
        dom = subprocess.run(flags + ["--dump-dom", url], capture_output=True, text=True, timeout=120, check=True)
    (evidence / f"{name}.dom.html").write_text(dom.stdout)
    (evidence / f"{name}.console.txt").write_text(dom.stderr)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(model: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "colibri.cli", "serve", "--model", str(model), "--port", str(port),
                                "--parallel", "3", "--ctx", "256", "--ram-budget", "4G"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    for _ in range(1200):
        try:
            with urllib.request.urlopen(url + "/health", timeout=1):
                return process, url
        except OSError:
            if process.poll() is not None:
                sys.exit(f"docs/screenshots.py: colibri serve stopped: {process.stderr.read().decode()[-500:]}")
            time.sleep(0.1)
    process.kill()
    sys.exit("docs/screenshots.py: colibri serve did not come up in 120 s")


def complete(url: str, prompt: str) -> None:
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 24}).encode()
    urllib.request.urlopen(urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"}),
                           timeout=300).read()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent, help="where the PNGs go (default: docs/)")
    parser.add_argument("--evidence", type=Path, help="where the DOMs, console logs and numbers go (default: not kept)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        evidence = args.evidence or work / "evidence"
        evidence.mkdir(parents=True, exist_ok=True)
        model = work / "tiny"
        convert(str(write_checkpoint(work / "src", "qwen3_moe")), model, ConvertOptions(quant="Q4_K_M", progress=False))
        (work / "in").mkdir()
        for i, title in enumerate(DOCUMENTS):
            (work / "in" / f"doc{i}.txt").write_text(f"{title}. " + "The town keeps its records here. " * (i + 1))
        job = ["run", "--model", str(model), "--prompt-dir", str(work / "in"), "--out-dir", str(work / "out"),
               "--max-tokens", "24", "--parallel", "4", "--expert-cache", "1800K", "--ram-budget", "4G",
               "--trace-routing", str(work / "trace.jsonl"), "--stats", str(work / "stats.json")]
        if colibri(job) != 0 or colibri(["report", str(work / "trace.jsonl"), "--stats", str(work / "stats.json"),
                                        "-o", str(work / "report.html")]) != 0:
            sys.exit("docs/screenshots.py: the job or its report failed")
        _, numbers = build_report(work / "trace.jsonl", json.loads((work / "stats.json").read_text()))
        shoot((work / "report.html").as_uri(), "report", args.out, evidence)

        process, url = serve(model)
        try:
            for _ in range(3):  # three rounds a few seconds apart: the time charts get points
                senders = [threading.Thread(target=complete, args=(url, title)) for title in DOCUMENTS[:3]]
                for sender in senders:
                    sender.start()
                for sender in senders:
                    sender.join()
                time.sleep(2 * SAMPLE_SECONDS)
            with urllib.request.urlopen(url + "/live.json", timeout=10) as reply:
                live = json.load(reply)
            shoot(url + "/", "live", args.out, evidence)
        finally:
            process.kill()
        (evidence / "numbers.json").write_text(json.dumps({"report": numbers, "live": live}))
    print(f"wrote {args.out / 'report.png'} and {args.out / 'live.png'}")


if __name__ == "__main__":
    main()
