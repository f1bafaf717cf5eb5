"""`colibri report`: the numbers it draws are the trace's and bench/policy.py's, and the HTML
needs nothing from the network."""

import json
import re
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

from colibri.cli import main
from colibri.convert.hf_to_colibri import ConvertOptions, convert
from colibri.convert.synthetic import write_checkpoint
from colibri.runtime.policy_replay import SHARES, belady, policy_table, read_trace, replay, step_requests, steps_of

BENCH_POLICY = Path(__file__).resolve().parent.parent / "bench" / "policy.py"


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """A --prompt-dir job run with --trace-routing and --stats, its report written."""
    root = tmp_path_factory.mktemp("report")
    convert(str(write_checkpoint(root / "src", "qwen3_moe")), root / "model", ConvertOptions(quant="Q4_K_M", progress=False))
    (root / "in").mkdir()
    for i in range(6):
        (root / "in" / f"doc{i}.txt").write_text(f"Document {i}: " + "the mill " * (i + 1))
    assert main(["run", "--model", str(root / "model"), "--prompt-dir", str(root / "in"), "--out-dir", str(root / "out"),
                 "--max-tokens", "12", "--parallel", "3", "--expert-cache", "300K", "--ram-budget", "8G",
                 "--trace-routing", str(root / "trace.jsonl"), "--stats", str(root / "stats.json")]) == 0
    assert main(["report", str(root / "trace.jsonl"), "--stats", str(root / "stats.json"), "-o", str(root / "r.html")]) == 0
    return root


def test_the_heat_map_counts_are_the_traces(job):
    from colibri.cli.report import build_report

    records = [json.loads(line) for line in (job / "trace.jsonl").read_text().splitlines()]
    _, numbers = build_report(job / "trace.jsonl", json.loads((job / "stats.json").read_text()))
    counts = np.array(numbers["counts"])
    want = np.zeros_like(counts)
    for r in records:
        for e in r["experts"]:
            want[numbers["layers"].index(r["layer"]), e] += 1
    assert counts.sum() == sum(len(r["experts"]) for r in records) and np.array_equal(counts, want)
    assert numbers["tokens"] == len(records) // len(numbers["layers"])  # a token: a row of a step, every MoE layer
    page = (job / "r.html").read_text()
    titles = [int(n) for n in re.findall(r"<title>layer \d+ expert \d+: (\d+)</title>", page)]
    assert sum(titles) == counts.sum() and len(titles) == np.count_nonzero(counts)


def test_the_replay_is_bench_policy_s_and_the_run_s(job):
    from colibri.cli.report import build_report
    from colibri.runtime.expert_store import POLICIES

    stats = json.loads((job / "stats.json").read_text())
    _, numbers = build_report(job / "trace.jsonl", stats)
    requests = read_trace(job / "trace.jsonl")
    for row in numbers["policies"]:
        for policy in POLICIES:
            assert row[policy] == replay(requests, row["cache_experts"], policy)
        assert row["belady"] == belady(requests, row["cache_experts"])
    # the replay over time runs at the run's own cache size, adds up to the whole replay's hit
    # rate, and gives the run's own lookups: each step asks for its rows' union once a layer
    assert numbers["cache_experts"] == stats["stats"]["expert_cache_slots"]
    lookups = sum(len(set(request)) for request in requests)
    overall = replay(requests, numbers["cache_experts"], "lru")
    assert abs(1 - sum(numbers["misses_per_token"]) / lookups - overall) < 1e-12
    assert lookups == stats["stats"]["expert_hits"] + stats["stats"]["expert_misses"]
    assert overall == stats["stats"]["expert_hit_rate"]
    assert numbers["job_tok_per_s"] > 0 and numbers["plan"]["batch"] <= 3


def test_bench_policy_gives_the_report_s_replay(job, tmp_path):
    """bench/policy.py, run as a script, prints the table the report draws from the same trace."""
    from colibri.cli.report import build_report

    _, numbers = build_report(job / "trace.jsonl", json.loads((job / "stats.json").read_text()))
    subprocess.run([sys.executable, str(BENCH_POLICY), str(job / "trace.jsonl"), "--sizes", *map(str, SHARES),
                    "--out", str(tmp_path / "policy.json")], check=True, capture_output=True)
    rows = json.loads((tmp_path / "policy.json").read_text())["results"]
    assert [{k: row[k] for k in numbers["policies"][0]} for row in rows] == numbers["policies"]


def test_the_report_is_self_contained(job):
    page = (job / "r.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and 'id="heat-map"' in page and 'id="policies"' in page
    assert 'id="hit-rate"' in page and 'id="job-tokens"' in page
    for outside in ("http://", "https://", "//cdn", "<script", "<link", "src=", "url("):
        assert outside not in page


def test_without_stats_the_cache_is_replayed_at_a_quarter_of_the_experts(job):
    from colibri.cli.report import build_report

    page, numbers = build_report(job / "trace.jsonl")
    distinct = int(np.count_nonzero(numbers["counts"]))
    assert numbers["cache_experts"] == distinct // 4 and 'id="heat-map"' in page and 'id="job-tokens"' not in page


def test_a_bad_trace_is_one_line(tmp_path, capsys):
    (tmp_path / "t.jsonl").write_text('{"layer": 0, "experts": [1, 2]}\n{"layer": "x"}\n')
    with pytest.raises(SystemExit, match=r"t.jsonl: line 2 is not a routing record"):
        main(["report", str(tmp_path / "t.jsonl"), "-o", str(tmp_path / "r.html")])
    assert not (tmp_path / "r.html").exists()
    (tmp_path / "s.json").write_text('{"stats": {}}')
    with pytest.raises(SystemExit, match=r"s.json: not the stats a colibri run --prompt-dir --stats wrote"):
        main(["report", str(tmp_path / "t.jsonl"), "--stats", str(tmp_path / "s.json"), "-o", str(tmp_path / "r.html")])


def batched_records(rows_per_step: list[int], layers=(1, 2, 3)) -> list[dict]:
    """A trace as a forward step writes it: each MoE layer once, all the step's rows together
    (row r chooses experts r and 7)."""
    return [{"step": step, "row": row, "layer": layer, "experts": [row, 7]}
            for step, rows in enumerate(rows_per_step) for layer in layers for row in range(rows)]


@pytest.mark.parametrize("rows_per_step", [[3, 3], [25] + [1] * 32, [1, 4, 2]])
def test_a_batched_trace_is_one_token_per_row_of_each_step(rows_per_step):
    records = batched_records(rows_per_step)
    steps = steps_of(records)
    assert [len(rows) for rows in steps] == rows_per_step  # 2 steps of 3 rows: 6 tokens, not 7; 25 + 32 = 57
    assert rows_per_step[0] < 2 or steps[0][1] == [[(1, 1), (1, 7)], [(2, 1), (2, 7)], [(3, 1), (3, 7)]]
    without = [{k: v for k, v in r.items() if k not in ("step", "row")} for r in records]  # an older trace
    assert steps_of(without) == steps


def test_a_step_asks_the_cache_for_its_rows_union_once():
    step = steps_of(batched_records([3]))[0]
    assert step_requests(step) == [[(layer, 0), (layer, 1), (layer, 2), (layer, 7)] for layer in (1, 2, 3)]
    # three rows that all choose expert 7: one lookup of it per layer, as ExpertStore.fetch reads it
    lookups = sum(len(request) for request in step_requests(step))
    assert lookups == 12 and sum(len(request) for row in step for request in row) == 18


def optimal_hit_rate(requests, capacity: int) -> float:
    """The best hit rate of any eviction choice (exhaustive search), under the runtime's rules:
    a missed expert is cached, evicting one the request itself does not need; when every
    cached one is needed, it is read without being cached."""
    flat = [(i, key) for i, request in enumerate(requests) for key in sorted(set(request))]

    @lru_cache(maxsize=None)
    def best(position: int, cached: frozenset) -> int:
        if position == len(flat):
            return 0
        i, key = flat[position]
        if key in cached:
            return 1 + best(position + 1, cached)
        if not capacity:
            return best(position + 1, cached)
        if len(cached) < capacity:
            return best(position + 1, cached | {key})
        victims = [v for v in cached if v not in set(requests[i])]
        if not victims:
            return best(position + 1, cached)
        return max(best(position + 1, (cached - {v}) | {key}) for v in victims)

    return best(0, frozenset()) / max(len(flat), 1)


def test_belady_is_the_best_any_eviction_order_gets():
    """At every cache size that holds the largest request: with less, a request's own experts
    cannot all stay, and farthest-next-use is not the best (the first trace below)."""
    rng = np.random.default_rng(11)
    for _ in range(300):
        requests = [[(0, int(e)) for e in rng.choice(6, rng.integers(1, 4), replace=False)]
                    for _ in range(rng.integers(3, 9))]
        for capacity in range(max(len(r) for r in requests), 6):
            assert belady(requests, capacity) == optimal_hit_rate(requests, capacity), (requests, capacity)
    smaller = [[(0, 1), (0, 2)], [(0, 0), (0, 5)], [(0, 3)], [(0, 0), (0, 2), (0, 5)], [(0, 5)]]
    assert belady(smaller, 2) < optimal_hit_rate(smaller, 2)  # why policy_table never goes below the largest
    assert all(row["cache_experts"] >= 3 for row in policy_table(smaller))
