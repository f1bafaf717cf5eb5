"""The report and the server's live page as a person sees them: docs/screenshots.py (the README's
screenshots) runs a real job and server and shoots both pages in headless Chromium; here the
heat map's cells and axes are drawn, the run's numbers are on the page, and the console shows no
error. Needs Debian's `chromium` package; skips, saying so, without it."""

import json
import re
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium not installed (Debian: apt install chromium)")
SCRIPT = Path(__file__).resolve().parent.parent / "docs" / "screenshots.py"


@pytest.fixture(scope="module")
def shots(tmp_path_factory):
    """(folder of report.png and live.png, folder of the DOMs, console logs and numbers.json)."""
    out, evidence = tmp_path_factory.mktemp("shots"), tmp_path_factory.mktemp("evidence")
    subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--evidence", str(evidence)],
                   check=True, capture_output=True, timeout=900)
    return out, evidence


def png_pixels(path: Path) -> np.ndarray:
    """The RGB pixels [height, width, 3] of an 8-bit, non-interlaced RGB or RGBA PNG (what Chromium writes)."""
    data, at, chunks = path.read_bytes(), 8, {}
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    while at < len(data):
        length, kind = int.from_bytes(data[at:at + 4], "big"), data[at + 4:at + 8]
        chunks.setdefault(kind, []).append(data[at + 8:at + 8 + length])
        at += 12 + length
    width, height, depth, colour, _, _, interlace = np.frombuffer(chunks[b"IHDR"][0][:13], ">u4,>u4,u1,u1,u1,u1,u1")[0]
    assert depth == 8 and colour in (2, 6) and interlace == 0, f"{path}: an unexpected PNG form"
    channels = 3 if colour == 2 else 4
    raw = np.frombuffer(zlib.decompress(b"".join(chunks[b"IDAT"])), np.uint8).reshape(height, 1 + width * channels)
    rows, previous = np.zeros((height, width * channels), np.int32), np.zeros(width * channels, np.int32)
    for y in range(height):
        kind, line = raw[y, 0], raw[y, 1:].astype(np.int32)
        if kind == 1:  # Sub, Average and Paeth depend on the pixel to the left: walk the row
            line = np.array(line)
            for x in range(channels, len(line)):
                line[x] = (line[x] + line[x - channels]) & 255
        elif kind == 2:
            line = (line + previous) & 255
        elif kind in (3, 4):
            out = np.array(line)
            for x in range(len(out)):
                left = out[x - channels] if x >= channels else 0
                up, corner = previous[x], previous[x - channels] if x >= channels else 0
                if kind == 3:
                    guess = (left + up) >> 1
                else:
                    p = left + up - corner
                    pa, pb, pc = abs(p - left), abs(p - up), abs(p - corner)
                    guess = left if pa <= pb and pa <= pc else up if pb <= pc else corner
                out[x] = (out[x] + guess) & 255
            line = out
        rows[y], previous = line, line
    return rows.reshape(height, width, channels)[:, :, :3].astype(np.uint8)


def heat_cells(pixels: np.ndarray) -> np.ndarray:
    """The pixels drawn as heat-map cells: rgb(s, s, 255), s below 255 (both pages shade so)."""
    r, g, b = (pixels[:, :, i].astype(int) for i in range(3))
    return (b == 255) & (r == g) & (r < 250)


def svg(dom: str) -> str:
    return dom.split('id="heat-map"', 1)[1].split("</svg>", 1)[0]


def console_errors(log: str) -> list[str]:
    return [line for line in log.splitlines() if "CONSOLE" in line and ("Uncaught" in line or "Error" in line)]


def test_the_screenshots_are_drawn(shots):
    out, _ = shots
    for name in ("report", "live"):
        pixels = png_pixels(out / f"{name}.png")
        cells = heat_cells(pixels)
        assert cells.sum() > 2000, f"{name}.png: no heat map cells drawn"
        assert len(np.unique(pixels[cells][:, 0])) >= 3, f"{name}.png: the cells are all one shade"
        assert (pixels.max(axis=2) < 80).sum() > 500, f"{name}.png: no text drawn"  # headings, labels, numbers


def test_the_report_shows_the_run(shots):
    _, evidence = shots
    dom, numbers = (evidence / "report.dom.html").read_text(), json.loads((evidence / "numbers.json").read_text())["report"]
    heat = svg(dom)
    drawn = np.count_nonzero(np.array(numbers["counts"]))
    assert heat.count("<title>layer ") == drawn > 8
    assert [int(t) for t in re.findall(r'text-anchor="end">(\d+)</text>', heat)] == numbers["layers"]  # the layer axis
    assert f"expert 0 .. {len(numbers['counts'][0]) - 1}" in heat  # the expert axis
    assert 'class="colour-scale"' in heat and f"<title>{np.max(numbers['counts'])} choices</title>" in heat
    for chart in ("hit-rate", "bytes-read"):  # the line charts: both axes ticked and numbered
        body = dom.split(f'id="{chart}"', 1)[1].split("</svg>", 1)[0]
        assert body.count('class="tick"') >= 4 and 'text-anchor="end">0</text>' in body, chart
    assert f"{numbers['tokens']} tokens" in dom and f"{numbers['job_tok_per_s']:.2f} tok/s" in dom
    for row in numbers["policies"]:
        assert f"<td>{row['lru']:.1%}</td>" in dom and f"<td>{row['belady']:.1%}</td>" in dom
    assert not console_errors((evidence / "report.console.txt").read_text())


def test_the_live_page_shows_the_server(shots):
    _, evidence = shots
    dom, live = (evidence / "live.dom.html").read_text(), json.loads((evidence / "numbers.json").read_text())["live"]
    heat = svg(dom)
    assert heat.count("<title>layer ") == sum(1 for row in live["heat"]["counts"] for n in row if n) > 0
    assert [int(t) for t in re.findall(r'text-anchor="end">(\d+)</text>', heat)] == live["heat"]["layers"]
    assert f"expert 0 .. {len(live['heat']['counts'][0]) - 1}" in heat
    assert f'id="generated">{live["generated_tokens"]}<' in dom and live["generated_tokens"] >= 24
    assert 'class="colour-scale"' in heat and "choices</title>" in heat
    for chart in ("history-rate", "history-hits", "history-read"):  # the time charts, axes numbered
        assert re.search(f'id="{chart}"' + r'.*?text-anchor="end">0</text>', dom), chart
    assert re.search(r'id="rate">\d+\.\d\d<', dom) and re.search(r'id="hits">\d+\.\d%<', dom)
    assert not console_errors((evidence / "live.console.txt").read_text())
