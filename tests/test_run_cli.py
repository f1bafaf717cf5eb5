"""`colibri run` and `colibri plan` end to end on tiny converted models."""

import json
import re
import subprocess
import sys

import numpy as np
import pytest

from colibri.cli import main
from colibri.convert.hf_to_colibri import ConvertOptions, convert
from colibri.convert.synthetic import write_checkpoint


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("run")
    src = write_checkpoint(root / "src", "qwen3_moe")
    convert(str(src), root / "model", ConvertOptions(quant="Q8_0", progress=False))
    return root / "model"


def run(argv, capsys):
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_prompt_json_gives_output_and_stats(model_dir, capsys):
    code, out, err = run(["run", "--model", str(model_dir), "--prompt", "The river", "--max-tokens", "8", "--json", "--ram-budget", "8G"], capsys)
    assert code == 0, err
    result = json.loads(out)
    stats = result["stats"]
    for key in ("prompt_tok_per_s", "generation_tok_per_s", "time_to_first_token_s", "expert_hit_rate",
                "expert_bytes_read_per_token", "peak_rss_bytes"):
        assert key in stats
    assert stats["prompt_tokens"] > 0 and 0 < stats["generated_tokens"] <= 8
    assert isinstance(result["output"], str)
    from colibri.runtime.kernels import kernel_paths

    assert stats["kernels"] == kernel_paths() and stats["kernels"]["k_quant_dot"]  # which instructions ran


def test_greedy_run_is_deterministic_and_prints_stats(model_dir, capsys):
    argv = ["run", "--model", str(model_dir), "--prompt", "Fishermen pulled", "--max-tokens", "6"]
    first = run(argv, capsys)
    second = run(argv, capsys)
    assert first[0] == 0 and first[1] == second[1]
    assert "tok/s" in first[2] and "hit rate" in first[2] and "peak RSS" in first[2]


def test_streaming_flags_keep_the_text_and_report_prefetch(model_dir, capsys):
    argv = ["run", "--model", str(model_dir), "--prompt", "Fishermen pulled", "--max-tokens", "6", "--ram-budget", "8G"]
    _, in_ram, in_ram_err = run(argv, capsys)
    code, streamed, err = run(argv + ["--expert-cache", "1M", "--prefetch", "on", "--direct-io"], capsys)
    assert code == 0, err
    assert streamed == in_ram and "prefetch accuracy" in err and "prefetch" not in in_ram_err
    code, mapped, err = run(argv + ["--expert-cache", "1M", "--io", "mmap", "--json"], capsys)
    assert code == 0, err
    result = json.loads(mapped)
    assert result["output"] == in_ram.rstrip("\n") and result["stats"]["io"] == "mmap" and result["stats"]["expert_resident_bytes"] > 0


def test_trace_routing_writes_one_line_per_token_per_moe_layer(model_dir, tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    code, out, err = run(["run", "--model", str(model_dir), "--prompt", "hello there", "--max-tokens", "4", "--json",
                          "--trace-routing", str(trace)], capsys)
    assert code == 0, err
    manifest = json.loads((model_dir / "colibri.json").read_text())
    config = manifest["config"]
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    stats = json.loads(out)["stats"]
    tokens = stats["prompt_tokens"] + stats["generated_tokens"]
    assert len(records) == tokens * len(config["moe_layers"])
    for r in records:
        assert r["layer"] in config["moe_layers"] and len(r["experts"]) == config["n_experts_used"]
        assert all(0 <= e < config["n_experts"] for e in r["experts"]) and len(r["weights"]) == len(r["experts"])
    assert sorted({r["position"] for r in records}) == list(range(tokens))


def test_prompt_dir_skips_done_and_isolates_failures(model_dir, tmp_path, capsys):
    inputs, outputs = tmp_path / "in", tmp_path / "out"
    inputs.mkdir()
    (inputs / "a.txt").write_text("The baker opened")
    (inputs / "b.json").write_text(json.dumps({"messages": [{"role": "user", "content": "Hello"}]}))
    (inputs / "c.json").write_text("{ not json")
    argv = ["run", "--model", str(model_dir), "--prompt-dir", str(inputs), "--out-dir", str(outputs), "--max-tokens", "4"]
    code, out, err = run(argv, capsys)
    assert code == 1 and "c.json: failed" in err and "2 written" in out and "1 failed" in out
    assert (outputs / "a.txt.out").exists() and (outputs / "b.json.out").exists() and not (outputs / "c.json.out").exists()
    before = (outputs / "a.txt.out").stat().st_mtime_ns
    code, out, err = run(argv, capsys)
    assert "0 written, 2 already done, 1 failed" in out
    assert (outputs / "a.txt.out").stat().st_mtime_ns == before


def test_prompt_dir_folder_logic(model_dir, tmp_path, capsys):
    """Answers keyed by the whole input name; bad JSON prompts named and skipped; per-file counts;
    an out-dir inside the prompt dir refused; an empty prompt and an oversized one isolated."""
    inputs, outputs = tmp_path / "in", tmp_path / "out"
    inputs.mkdir()
    (inputs / "a.txt").write_text("The baker opened")
    (inputs / "a.md").write_text("The river ran past the mill and")
    (inputs / "m.json").write_text(json.dumps({"messages": "not a list"}))
    (inputs / "n.json").write_text(json.dumps({"messages": [{"role": 1, "content": "x"}]}))
    (inputs / "empty.txt").write_text("")
    (inputs / "huge.txt").write_text("word " * 200_000)
    argv = ["run", "--model", str(model_dir), "--prompt-dir", str(inputs), "--out-dir", str(outputs),
            "--max-tokens", "3", "--ctx", "64"]
    code, out, err = run(argv, capsys)
    assert code == 1 and "2 written" in out and "4 failed" in out
    assert (outputs / "a.txt.out").exists() and (outputs / "a.md.out").exists()
    assert "m.json: failed" in err and "non-empty list" in err and "n.json: failed" in err and "message 0" in err
    assert "empty.txt: failed" in err and "huge.txt: failed" in err and "cannot fit" in err
    counts = [re.fullmatch(r"a\.(md|txt): (\d+) prompt tokens, (\d+) generated", line)
              for line in err.splitlines() if line.startswith("a.")]
    assert len(counts) == 2 and all(counts)
    assert all(int(c[3]) <= 3 for c in counts)  # each file's own count, not the run's running total
    assert int(counts[0][2]) > int(counts[1][2])  # a.md's prompt is the longer one
    for out_dir in (inputs, inputs / "answers"):
        with pytest.raises(SystemExit, match="inside --prompt-dir"):
            run(["run", "--model", str(model_dir), "--prompt-dir", str(inputs), "--out-dir", str(out_dir)], capsys)


def test_hostile_chat_template_is_refused(model_dir, tmp_path, capsys, monkeypatch):
    import shutil

    hostile = tmp_path / "hostile"
    shutil.copytree(model_dir, hostile)
    (hostile / "chat_template.jinja").write_text("{{ ''.__class__.__mro__[1].__subclasses__() }}")
    inputs = tmp_path / "in"
    inputs.mkdir()
    (inputs / "x.json").write_text(json.dumps([{"role": "user", "content": "hi"}]))
    code, out, err = run(["run", "--model", str(hostile), "--prompt-dir", str(inputs), "--out-dir", str(tmp_path / "o")], capsys)
    assert code == 1 and "refused" in err and "chat_template.jinja" in err


def test_missing_and_corrupt_manifest(model_dir, tmp_path, capsys):
    code, out, err = run(["run", "--model", str(tmp_path), "--prompt", "x"], capsys)
    assert code == 1 and "colibri.json" in err and "unfinished conversion" in err
    (tmp_path / "colibri.json").write_text("{}")
    code, out, err = run(["run", "--model", str(tmp_path), "--prompt", "x"], capsys)
    assert code == 1 and "invalid manifest" in err and err.count("\n") == 1


def test_context_overflow_is_a_clear_error(model_dir, capsys):
    code, out, err = run(["run", "--model", str(model_dir), "--prompt", "word " * 40, "--ctx", "16"], capsys)
    assert code == 1 and "context full" in err and "--ctx 16" in err


def test_generation_stops_at_ctx(model_dir, capsys):
    code, out, err = run(["run", "--model", str(model_dir), "--prompt", "a b", "--ctx", "12", "--max-tokens", "100", "--json"], capsys)
    assert code == 0, err
    stats = json.loads(out)["stats"]
    assert stats["prompt_tokens"] + stats["generated_tokens"] <= 12


def test_budget_too_small_gives_the_numbers(model_dir, capsys):
    code, out, err = run(["run", "--model", str(model_dir), "--prompt", "x", "--ram-budget", "10M"], capsys)
    assert code == 1 and "--ram-budget" in err and "needs at least" in err


def test_plan_table_and_json(model_dir, capsys):
    code, out, err = run(["plan", "--model", str(model_dir), "--ram", "2G", "--disk-bw", "2.5"], capsys)
    assert code == 0, err
    assert "resident weights" in out and "KV cache" in out and "decode ceiling" in out and "--expert-cache" in out
    code, out, err = run(["plan", "--model", str(model_dir), "--ram", "2G", "--ctx", "1024", "--disk-bw", "measure", "--json"], capsys)
    plan = json.loads(out)
    assert code == 0 and plan["ctx"] == 1024 and plan["disk_bandwidth"] > 0 and plan["ceiling_tok_per_s"] > 0
    assert set(plan["io"]["modes"]) == {"pread", "direct", "mmap"} and plan["io"]["recommended"] in plan["io"]["modes"]


def test_plan_explains_the_io_modes_and_picks_direct_under_a_container_limit(model_dir, tmp_path, capsys, monkeypatch):
    from colibri.runtime import memory, plan
    from colibri.runtime.memory import container_memory_limit

    code, out, _ = run(["plan", "--model", str(model_dir), "--ram", "2G"], capsys)
    assert code == 0 and "experts read with --io:" in out and "    mmap    the files mapped" in out and "here: --io " in out
    # a cgroup v2 limit of 4 GiB, and a v1 hierarchy without one
    (tmp_path / "v2" / "job").mkdir(parents=True)
    (tmp_path / "v2" / "job" / "memory.max").write_text(f"{4 << 30}\n")
    (tmp_path / "cgroup").write_text("0::/job\n")
    (tmp_path / "v1" / "memory").mkdir(parents=True)
    (tmp_path / "v1" / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    (tmp_path / "cgroup1").write_text("4:memory:/\n")
    monkeypatch.setattr(memory, "total_ram", lambda: 64 << 30)
    assert container_memory_limit(str(tmp_path / "v2"), str(tmp_path / "cgroup")) == 4 << 30
    assert container_memory_limit(str(tmp_path / "v1"), str(tmp_path / "cgroup1")) is None
    monkeypatch.setattr(plan, "container_memory_limit", lambda: 4 << 30)
    code, out, _ = run(["plan", "--model", str(model_dir), "--ram", "2G"], capsys)
    assert "here: --io direct (a container memory limit of 4.00G was found" in out and "--io direct" in out.splitlines()[-1]


def test_rss_stays_in_budget_while_streaming(tmp_path):
    """2,000 generated tokens with experts larger than the expert cache: RSS ≤ budget + 10%, no growth."""
    src = write_checkpoint(tmp_path / "src", "mixtral")
    convert(str(src), tmp_path / "model", ConvertOptions(quant="Q4_K_M", progress=False))
    script = f"""
import json, numpy as np
from colibri.runtime import open_model
from colibri.runtime.memory import current_rss
m = open_model({str(tmp_path / 'model')!r}, ctx=2100, ram_budget="700M", expert_cache="400K", kv_quant="f16")
assert m.store.cache_bytes < sum(t.stride * t.count for t in m.layout.expert_layers.values())
token, samples = 1, []
logits = m.prefill([1, 2, 3])[-1]
for step in range(2000):
    token = int(np.argmax(logits))
    logits = m.decode(token)
    if step % 50 == 0:
        samples.append(current_rss())
print(json.dumps({{"samples": samples, "stats": m.stats()}}))
"""
    # a first short run fills numba's cache, so the measured run pays no JIT-compilation memory
    warm_up = subprocess.run([sys.executable, "-c", script.replace("range(2000)", "range(2)")], capture_output=True, text=True, timeout=600)
    assert warm_up.returncode == 0, warm_up.stderr
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    budget = 700 << 20
    # RSS sampled through the generation; the process's lifetime peak also counts numba's
    # JIT compiler, which a cold kernel cache can push past the budget once at start-up
    assert max(result["samples"]) <= budget * 1.1, result["samples"]
    assert result["stats"]["expert_misses"] > 0 and result["stats"]["expert_evictions"] > 0
    warm = result["samples"][2:]
    assert max(warm) - min(warm) < 16 << 20, warm  # no growth after warm-up


def test_chat_reads_turns_from_stdin(model_dir):
    command = [sys.executable, "-m", "colibri.cli", "run", "--model", str(model_dir), "--chat", "--max-tokens", "3"]
    done = subprocess.run(command, input="Hello\nAnd again\n\n", capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("\n") == 2  # one reply line per turn


@pytest.mark.parametrize("kind, median_cos", [("f16", 0.9999), ("q8_0", 0.999)])
def test_quantized_kv_cache_stays_close_to_f32(model_dir, kind, median_cos):
    from colibri.runtime import open_model

    ids = list(range(5, 45))
    reference = open_model(model_dir, ctx=64, kv_quant="f32").prefill(ids)
    got = open_model(model_dir, ctx=64, kv_quant=kind).prefill(ids)
    cos = (got * reference).sum(-1) / (np.linalg.norm(got, axis=-1) * np.linalg.norm(reference, axis=-1))
    assert np.median(cos) >= median_cos  # the median: a router flip can move one row a lot
    assert open_model(model_dir, ctx=64, kv_quant=kind).cache.nbytes < open_model(model_dir, ctx=64, kv_quant="f32").cache.nbytes


def test_prompts_the_model_cannot_take_are_one_line_errors(model_dir, capsys):
    """An empty prompt, token ids outside the vocabulary, and a 50 MB prompt against --ctx 256
    (refused from its length, without tokenizing it)."""

    from colibri.runtime import open_model
    from colibri.runtime.engine import PromptError
    from colibri.runtime.kv_cache import ContextOverflow

    code, out, err = run(["run", "--model", str(model_dir), "--prompt", ""], capsys)
    assert code == 1 and "prompt is empty" in err and err.count("\n") == 1
    m = open_model(model_dir, ctx=256, ram_budget="8G")
    for ids in ([], [m.config.vocab_size], [-1]):
        with pytest.raises(PromptError):
            m.prefill(ids)
    def never(*args, **kwargs):
        raise AssertionError("the prompt was tokenized")

    m.tokenizer.encode = never
    with pytest.raises(ContextOverflow, match="cannot fit --ctx 256"):
        next(m.generate("a" * (50 << 20)))


def test_plan_batch_table_from_uniform_routing_a_trace_and_measured_costs(model_dir, tmp_path, capsys):
    from colibri.formats.layout import ModelLayout
    from colibri.runtime.plan import distinct_traced, distinct_uniform, traced_choices

    assert distinct_uniform(32, 4, 1) == 4 and abs(distinct_uniform(32, 4, 32) - 31.6) < 0.1  # the numbers
    trace = tmp_path / "trace.jsonl"
    code, _, err = run(["run", "--model", str(model_dir), "--prompt", "The river", "--max-tokens", "6",
                        "--trace-routing", str(trace)], capsys)
    assert code == 0, err
    config = ModelLayout(model_dir).config
    layers = traced_choices(trace, config.n_experts)
    assert distinct_traced(layers, 1) == len(layers) * config.n_experts_used
    assert distinct_traced(layers, 4) <= len(layers) * min(4 * config.n_experts_used, config.n_experts)
    code, out, err = run(["plan", "--model", str(model_dir), "--ram", "2G", "--disk-bw", "2", "--trace", str(trace),
                          "--measure-speed", "--json"], capsys)
    assert code == 0, err
    p = json.loads(out)
    assert p["routing"] == "trace" and set(p["costs"]) >= {"step_s", "per_expert_s", "per_row_s"}
    rows = p["batches"]
    assert [r["batch"] for r in rows] == [1, 2, 4, 8, 16, 32, 64]
    assert all(r["kv_bytes"] == r["batch"] * p["kv_cache_bytes"] for r in rows)
    assert all(r["expected_tok_per_s"] > 0 and r["expected_disk_tok_per_s"] <= r["expected_tok_per_s"] for r in rows)
    assert rows[-1]["expected_tok_per_s"] > rows[0]["expected_tok_per_s"]
    assert p["expected_tok_per_s"] == rows[0]["expected_disk_tok_per_s"]
    code, out, err = run(["plan", "--model", str(model_dir), "--ram", "2G", "--disk-bw", "2", "--trace", str(trace),
                          "--docs", "9", "--doc-tokens", "12", "--gen-tokens", "3"], capsys)
    assert code == 0 and "experts from a routing trace" in out
    code, out, err = run(["plan", "--model", str(model_dir), "--ram", "2G"], capsys)
    assert code == 0 and "batches (--parallel B" in out and "ceilings only" in out
    (tmp_path / "bad.jsonl").write_text('{"layer": 0, "experts": [99999]}\n')
    code, out, err = run(["plan", "--model", str(model_dir), "--ram", "2G", "--trace", str(tmp_path / "bad.jsonl")], capsys)
    assert code == 1 and "bad.jsonl line 1" in err


def test_plan_of_a_sweep_gives_its_window_time_reads_and_scratch(model_dir, tmp_path, capsys):
    """`colibri plan --docs`: the sweep `colibri run --sweep` would run, its time from costs
    measured here with --measure-speed, whatever this process holds besides (a plan counts
    the run's runtime, not its own footprint); its flags are checked in one line each."""
    held = np.ones(3 << 27)  # 3 GiB, more than the 2G plan's budget
    job = ["plan", "--model", str(model_dir), "--ram", "2G", "--disk-bw", "1", "--docs", "40", "--doc-tokens", "30",
           "--gen-tokens", "6"]
    code, out, err = run(job + ["--parallel", "16", "--measure-speed", "--json"], capsys)
    assert code == 0, err
    p = json.loads(out)
    s, costs = p["sweep"], p["costs"]
    assert s["fits"] and s["window"] == 16 and s["windows"] == 3 and s["ctx"] == 36 and s["scratch_bytes"] == 0
    assert costs["doc_tokens"] == 30 and costs["prompt_token_s"] > 0 and costs["per_row_s"] >= 0
    assert max(s["compute_s"], s["disk_s"]) <= s["seconds"] <= s["compute_s"] + s["disk_s"]
    assert s["disk_s"] == pytest.approx(s["bytes_read"] / 1e9)
    assert s["tok_per_s"] == pytest.approx(40 * 6 / s["seconds"]) and s["bound_by"] in ("disk", "compute")
    assert s["bytes_per_generated_token"] == pytest.approx(s["bytes_read"] / 240)
    code, out, err = run(job + ["--scratch", str(tmp_path)], capsys)
    assert code == 0, err
    assert "a sweep of 40 documents" in out and f"in --scratch {tmp_path}" in out and "compute not measured" in out
    assert "--sweep --parallel" in out and f"--scratch {tmp_path}" in out
    code, out, err = run(job[:-6] + ["--ram", "300M", "--docs", "4", "--doc-tokens", "30", "--gen-tokens", "6",
                                     "--parallel", "4000"], capsys)
    assert code == 1 and "    does NOT fit: --ram-budget" in out  # the sweep's line, with the budget's numbers
    for extra, line in ((["--gen-tokens", "6"], "--gen-tokens needs --docs"),
                        (["--docs", "3", "--gen-tokens", "6"], "--docs needs --doc-tokens"),
                        (["--docs", "0", "--doc-tokens", "3", "--gen-tokens", "6"], "--docs must be at least 1, got 0"),
                        (["--docs", "3", "--doc-tokens", "3", "--gen-tokens", "6", "--scratch", str(tmp_path / "no")],
                         f"--scratch {tmp_path / 'no'}: not an existing folder")):
        with pytest.raises(SystemExit) as refused:
            run(["plan", "--model", str(model_dir), "--ram", "2G"] + extra, capsys)
        assert str(refused.value) == f"colibri plan: error: {line}"
    del held


def test_prompt_dir_json_gives_each_document_and_the_batch_numbers(model_dir, tmp_path, capsys):
    inputs, outputs = tmp_path / "in", tmp_path / "out"
    inputs.mkdir()
    for i in range(5):
        (inputs / f"d{i}.txt").write_text("The river " * (i + 1))
    code, out, err = run(["run", "--model", str(model_dir), "--prompt-dir", str(inputs), "--out-dir", str(outputs),
                          "--max-tokens", "5", "--parallel", "3", "--json"], capsys)
    assert code == 0, err
    summary = json.loads(out)
    assert summary["written"] == 5 and summary["parallel"] == 3 and set(summary["documents"]) == {f"d{i}.txt" for i in range(5)}
    assert all(d["prompt_tokens"] > 0 and 0 < d["generated_tokens"] <= 5 for d in summary["documents"].values())
    stats = summary["stats"]
    assert stats["rows_per_step"] > 1 and stats["distinct_experts_per_step"] > 0 and stats["tok_per_s"] > 0
    assert stats["generated_tokens"] == sum(d["generated_tokens"] for d in summary["documents"].values())
    assert not list(outputs.glob("*.partial"))


def test_ray_without_the_extra_says_how_to_install_it(model_dir, tmp_path, capsys, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def without_ray(name, *args, **kwargs):
        if name == "ray" or name.startswith("ray."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without_ray)
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("hello")
    argv = ["run", "--model", str(model_dir), "--prompt-dir", str(tmp_path / "in"), "--out-dir", str(tmp_path / "out"),
            "--ray", "local"]
    with pytest.raises(SystemExit, match=r"--ray needs Ray: pip install 'colibri-moe\[ray\]'"):
        main(argv)
    with pytest.raises(SystemExit, match="--ray needs --prompt-dir"):
        main(["run", "--model", str(model_dir), "--prompt", "hi", "--ray", "local"])


@pytest.mark.parametrize("argv, named", [
    (["run", "--model", "{model}", "--prompt-file", "{tmp}/missing.txt"], "{tmp}/missing.txt: No such file"),
    (["run", "--model", "{model}", "--prompt", "hi", "--trace-routing", "{tmp}/no/dir/t.jsonl"],
     "{tmp}/no/dir/t.jsonl: No such file"),
    (["run", "--model", "{model}", "--prompt", "hi", "--parallel", "0"], "--parallel must be at least 1, got 0"),
    (["run", "--model", "{model}", "--prompt", "hi", "--kv-quant", "q4"], "--kv-quant: invalid choice: 'q4'"),
    (["plan", "--model", "{model}", "--ram", "8G", "--disk-bw", "abc"], "--disk-bw: 'abc' is not a read bandwidth"),
    (["plan", "--model", "{model}", "--ram", "8G", "--disk-bw", "-1"], "--disk-bw: '-1' is not a read bandwidth"),
    (["smoke", "{tmp}/nowhere", "--record", "{tmp}/b.json"], "{tmp}/nowhere"),
])
def test_ordinary_mistakes_are_one_line_naming_the_file_or_flag(model_dir, tmp_path, capsys, argv, named):
    fill = {"model": str(model_dir), "tmp": str(tmp_path)}
    argv, named = [a.format(**fill) for a in argv], named.format(**fill)
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's usage errors, and the commands' own one-line exits
        code, message = e.code, e.code if isinstance(e.code, str) else ""
    else:
        message = ""
    err = message or capsys.readouterr().err
    assert code not in (0, None)
    assert "Traceback" not in err
    assert named in err.strip().splitlines()[-1], err


def test_serve_without_its_extra_says_how_to_install_it(model_dir, monkeypatch):
    import importlib.util

    from colibri.cli.server import command

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "uvicorn" else real(name, *a))
    with pytest.raises(SystemExit, match=r"^colibri serve: error: the server needs uvicorn: pip install 'colibri-moe\[serve\]'$"):
        command.serve_command(command_args(["serve", "--model", str(model_dir)]))


def command_args(argv):
    from colibri.cli import build_parser

    return build_parser().parse_args(argv)
