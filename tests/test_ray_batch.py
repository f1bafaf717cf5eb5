"""`colibri run --prompt-dir --ray` and `ColibriGenerator` on a local Ray cluster (the optional
`ray` extra): the answers of the single-machine job, each document once, even when an actor
process is killed mid-run."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from colibri.convert.hf_to_colibri import ConvertOptions, convert
from colibri.convert.synthetic import write_checkpoint

ray = pytest.importorskip("ray", reason="the optional ray extra is not installed (pip install 'colibri-moe[ray]')")

DOCUMENTS = 16


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("ray")
    convert(str(write_checkpoint(root / "src", "qwen3_moe")), root / "model", ConvertOptions(quant="Q4_K_M", progress=False))
    (root / "in").mkdir()
    for i in range(DOCUMENTS):
        (root / "in" / f"doc{i:02d}.txt").write_text(f"Document {i}: " + "the river " * (1 + i % 5))
    (root / "in" / "chat.json").write_text(json.dumps({"messages": [{"role": "user", "content": "hello"}]}))
    return root


def colibri(*argv, **kwargs):
    return subprocess.Popen([sys.executable, "-m", "colibri.cli", "run", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kwargs)


def answers(out):
    return {p.name: p.read_text() for p in sorted(out.glob("*.out"))}


def test_a_ray_job_gives_the_single_machine_answers_once_each_even_when_an_actor_dies(job):
    common = ["--model", str(job / "model"), "--prompt-dir", str(job / "in"), "--max-tokens", "64", "--threads", "1",
              "--ram-budget", "2G", "--parallel", "2"]
    alone = colibri(*common, "--out-dir", str(job / "alone"))
    assert alone.wait(timeout=600) == 0, alone.stderr.read()
    want = answers(job / "alone")
    assert len(want) == DOCUMENTS + 1

    # --ray local starts a cluster of its own, even where RAY_ADDRESS names another (here: nothing)
    spread = colibri(*common, "--out-dir", str(job / "ray"), "--ray", "local", "--ray-actors", "2", "--json",
                     env=dict(os.environ, RAY_ADDRESS="127.0.0.1:9"))
    deadline = time.monotonic() + 600
    while not list((job / "ray").glob("*.out")) and time.monotonic() < deadline and spread.poll() is None:
        time.sleep(0.05)
    workers = subprocess.run(["pgrep", "-f", "ray::ColibriGenerator"], capture_output=True, text=True).stdout.split()
    assert workers, "no actor process found"
    os.kill(int(workers[0]), signal.SIGKILL)  # one node lost mid-job
    out, err = spread.communicate(timeout=600)
    assert spread.returncode == 0, err
    assert "a Ray actor died" in err  # the kill hit a chunk in flight, which the other actor then answered
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["written"] == DOCUMENTS + 1 and summary["failed"] == [] and summary["actors"] == 2
    assert answers(job / "ray") == want
    again = colibri(*common, "--out-dir", str(job / "ray"), "--ray", "local", "--ray-actors", "2", "--json")
    out, err = again.communicate(timeout=600)
    assert again.returncode == 0, err
    assert json.loads(out.strip().splitlines()[-1])["skipped_done"] == DOCUMENTS + 1 and answers(job / "ray") == want


def test_the_generator_runs_ray_data_style_batches(job):
    from colibri.ray_batch import ColibriGenerator  # the documented import

    generator = ColibriGenerator(str(job / "model"), parallel=3, ram_budget="8G", ctx=256)
    batch = {"id": ["a", "b", "c", "d"], "prompt": ["Document 1: the river ", "Document 2: ", "x" * 5000, "hi"],
             "max_tokens": [6, 4, 4, 3]}
    out = generator(batch)
    assert out["id"] == ["a", "b", "c", "d"] and out["generated_tokens"][:2] == [6, 4] and out["generated_tokens"][3] == 3
    assert out["error"][2] is not None and out["text"][2] is None  # too long for the context: that row alone fails
    alone = ColibriGenerator(str(job / "model"), parallel=1, ram_budget="8G", ctx=256)({"prompt": ["Document 2: "], "max_tokens": [4]})
    assert alone["text"][0] == out["text"][1]


def test_ray_data_map_batches_runs_the_generator_on_an_actor_pool(job):
    pytest.importorskip("ray.data", reason="Ray Data is not installed (pip install 'ray[data]')")
    from colibri.ray_batch import ColibriGenerator  # the documented import

    prompts = [f"Document {i}: the river" for i in range(6)]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        rows = ray.data.from_items([{"id": i, "prompt": p, "max_tokens": 5} for i, p in enumerate(prompts)]).map_batches(
            ColibriGenerator, fn_constructor_kwargs={"model": str(job / "model"), "parallel": 3, "ram_budget": "8G",
                                                     "ctx": 256, "threads": 1},
            concurrency=2, batch_size=3, num_cpus=0).take_all()
    finally:
        ray.shutdown()
    alone = ColibriGenerator(str(job / "model"), parallel=1, ram_budget="8G", ctx=256)
    want = alone({"prompt": prompts, "max_tokens": [5] * len(prompts)})["text"]
    assert sorted((row["id"], row["text"], row["generated_tokens"]) for row in rows) == \
        [(i, text, 5) for i, text in enumerate(want)]

def test_stats_and_trace_routing_are_merged_from_the_actors(job, tmp_path):
    from colibri.runtime.policy_replay import steps_of

    run = colibri("--model", str(job / "model"), "--prompt-dir", str(job / "in"), "--out-dir", str(tmp_path / "out"),
                  "--max-tokens", "8", "--threads", "1", "--ram-budget", "2G", "--parallel", "2", "--ray", "local",
                  "--ray-actors", "2", "--stats", str(tmp_path / "stats.json"),
                  "--trace-routing", str(tmp_path / "trace.jsonl"))
    out, err = run.communicate(timeout=600)
    assert run.returncode == 0, err
    stats = json.loads((tmp_path / "stats.json").read_text())
    each, merged, documents = stats["actor_stats"], stats["stats"], stats["documents"]
    assert len(each) == 2 and all(s["generated_tokens"] > 0 for s in each)  # both actors worked
    assert merged["generated_tokens"] == sum(d["generated_tokens"] for d in documents.values())
    assert merged["prompt_tokens"] == sum(d["prompt_tokens"] for d in documents.values()) == sum(
        s["prompt_tokens"] for s in each)
    assert merged["expert_hits"] == sum(s["expert_hits"] for s in each)
    hits, lookups = merged["expert_hits"], merged["expert_hits"] + merged["expert_misses"]
    assert merged["expert_hit_rate"] == hits / lookups and len(documents) == DOCUMENTS + 1
    records = [json.loads(line) for line in (tmp_path / "trace.jsonl").read_text().splitlines()]
    assert {r["actor"] for r in records} == {0, 1}
    # the trace's tokens are the ones the actors ran: every prompt token and every generated
    # one that was fed back (all but each document's last)
    rows = sum(len(step) for step in steps_of(records))
    assert rows == merged["prompt_tokens"] + merged["generated_tokens"] - len(documents)
    steps = [r["step"] for r in records]
    assert steps == sorted(steps) and len(set(steps)) == merged["steps"]
    from colibri.cli import main

    assert main(["report", str(tmp_path / "trace.jsonl"), "--stats", str(tmp_path / "stats.json"),
                 "-o", str(tmp_path / "r.html")]) == 0
