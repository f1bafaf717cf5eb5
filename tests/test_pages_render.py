"""The report and the server's live page rendered in headless Chromium: the heat map is drawn and
the console shows no error. Needs Debian's `chromium` package; skips, saying so, without it."""

import json
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium not installed (Debian: apt install chromium)")


def render(url: str, screenshot: Path) -> tuple[str, str]:
    """(the DOM after the page's scripts ran, Chromium's console log) of `url`; a screenshot too."""
    flags = [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=4000",
             "--window-size=1100,900", "--enable-logging=stderr", "--v=0"]
    subprocess.run(flags + [f"--screenshot={screenshot}", url], capture_output=True, timeout=120, check=True)
    done = subprocess.run(flags + ["--dump-dom", url], capture_output=True, text=True, timeout=120, check=True)
    return done.stdout, done.stderr


def console_errors(log: str) -> list[str]:
    return [line for line in log.splitlines() if "CONSOLE" in line and ("Uncaught" in line or "Error" in line)]


def test_the_report_renders(tmp_path):
    from colibri.report import build_report

    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"position": p, "layer": layer, "experts": [(p + layer) % 8, (p * 3) % 8]}) + "\n"
                             for p in range(40) for layer in range(4)))
    page, _ = build_report(trace)
    (tmp_path / "report.html").write_text(page)
    dom, log = render((tmp_path / "report.html").as_uri(), tmp_path / "report.png")
    assert 'id="heat-map"' in dom and dom.count("<rect") > 8 and (tmp_path / "report.png").stat().st_size > 1000
    assert not console_errors(log), console_errors(log)


def test_the_live_page_renders(tmp_path):
    sys.path.insert(0, str(Path(__file__).parent))
    from test_serve import start

    from colibri.convert.hf_to_colibri import ConvertOptions, convert
    from colibri.convert.synthetic import write_checkpoint

    convert(str(write_checkpoint(tmp_path / "src", "qwen3_moe")), tmp_path / "tiny", ConvertOptions(progress=False))
    process, url = start(tmp_path / "tiny")
    try:
        body = json.dumps({"model": "tiny", "prompt": "Hello", "max_tokens": 6}).encode()
        urllib.request.urlopen(urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"}))
        time.sleep(0.5)
        dom, log = render(url + "/", tmp_path / "live.png")
    finally:
        process.kill()
    assert 'id="heat-map"' in dom and "<rect" in dom.split('id="heat-map"')[1] and (tmp_path / "live.png").stat().st_size > 1000
    assert not console_errors(log), console_errors(log)
