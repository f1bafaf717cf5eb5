"""The SVG charts of the report and the live page, and the live page's sampled history."""

import re
import time
from types import SimpleNamespace

import numpy as np

from colibri.cli.charts import heat_svg, line_svg, nice_ticks
from colibri.cli.server.live import History


def test_ticks_are_round_and_span_the_range():
    assert nice_ticks(0, 1) == [0, 0.2, 0.4, 0.6, 0.8, 1.0]
    assert nice_ticks(0, 63, 12) == [0, 10, 20, 30, 40, 50, 60]
    assert nice_ticks(-300, 0, 10) == [-300, -250, -200, -150, -100, -50, 0]
    assert nice_ticks(5, 5) == [5]


def test_a_line_chart_has_numbered_axes_a_legend_and_gaps():
    svg = line_svg("c", [("hit rate", [0.5, None, 0.7, 0.8]), ("predicted", [0.4, 0.4, 0.4, 0.4])], "rate", "step")
    assert svg.count("<polyline") == 2 and svg.count("<circle") == 1  # the gap leaves 0.5 alone: a dot
    assert re.findall(r'text-anchor="end">([\d.]+)</text>', svg) == ["0", "0.2", "0.4", "0.6", "0.8"]
    assert svg.count(">hit rate</text>") == 1 and svg.count(">predicted</text>") == 1
    assert "no points yet" in line_svg("e", [("rate", [])], "rate", "s") and "no points yet" not in svg


def test_the_heat_map_titles_every_cell_and_scales_its_colours():
    counts = np.zeros((3, 16), np.int64)
    counts[0, 3], counts[2, 15] = 40, 1
    svg = heat_svg([1, 2, 5], counts)
    assert re.findall(r"<title>layer (\d+) expert (\d+): (\d+)</title>", svg) == [("1", "3", "40"), ("5", "15", "1")]
    scale = svg.split('class="colour-scale"', 1)[1]
    assert "<title>40 choices</title>" in scale and "<title>1 choices</title>" in scale
    assert 'fill="rgb(40,40,255)"' in svg  # the most chosen cell is the scale's darkest


def test_the_history_samples_rates_between_two_readings():
    store = {"expert_hits": 0, "expert_misses": 0, "expert_bytes_read": 0}
    engine = SimpleNamespace(scheduler=SimpleNamespace(counters={"generated_tokens": 0}),
                             model=SimpleNamespace(store=SimpleNamespace(stats=lambda: dict(store))))
    history = History(engine, every=0.2)
    try:
        time.sleep(0.3)  # one quiet interval: no lookups, so no hit rate
        engine.scheduler.counters["generated_tokens"] = 10
        store.update(expert_hits=3, expert_misses=1, expert_bytes_read=2_000_000)
        deadline = time.monotonic() + 5
        while len(history.points) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        history.close()
    (_, quiet_rate, quiet_hits, _), (_, rate, hits, read) = list(history.points)[:2]
    assert quiet_rate == 0 and quiet_hits is None
    assert hits == 0.75 and 10 / 0.4 < rate < 10 / 0.15 and 2 / 0.4 < read < 2 / 0.15
    assert len(history.charts()) == 3
