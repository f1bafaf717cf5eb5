"""`colibri report`: the numbers it draws are the trace's and bench/policy.py's, and the HTML
needs nothing from the network."""

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from colibri.cli import main
from colibri.convert.hf_to_colibri import ConvertOptions, convert
from colibri.convert.synthetic import write_checkpoint
from colibri.cli.report import SHARES
from colibri.runtime.policy_replay import belady, read_trace, replay

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
    # the replay over time runs at the run's own cache size, and adds up to the whole replay's hit rate
    assert numbers["cache_experts"] == stats["stats"]["expert_cache_slots"]
    lookups = sum(len(set(request)) for request in requests)
    overall = replay(requests, numbers["cache_experts"], "lru")
    assert abs(1 - sum(numbers["misses_per_token"]) / lookups - overall) < 1e-12 and 0 < overall < 1
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
