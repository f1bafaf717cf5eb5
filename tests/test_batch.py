"""Many sequences at once (`runtime.batch`): every sequence gets the bits it gets alone."""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from colibri.convert.hf_to_colibri import ConvertOptions, convert
from colibri.convert.synthetic import write_checkpoint

# 8 prompts of different lengths (one longer than two prefill chunks) and max_tokens;
# odd ones sampled with a seed, even ones greedy
LENGTHS = (5, 70, 12, 1, 130, 33, 64, 9)
MAX_TOKENS = (7, 3, 12, 5, 9, 4, 6, 10)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """`models(arch, quant)`: a converted tiny model folder."""
    made = {}

    def get(arch, quant="Q4_K_M"):
        if (arch, quant) not in made:
            root = tmp_path_factory.mktemp(f"batch-{arch}-{quant}")
            src = write_checkpoint(root / "src", arch)
            convert(str(src), root / "model", ConvertOptions(quant=quant, progress=False))
            made[arch, quant] = root / "model"
        return made[arch, quant]

    return get


def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(3, 200, n).tolist() for n in LENGTHS]


def sampling(i):
    return {"temperature": 0.8, "top_k": 40, "seed": i} if i % 2 else {}


def run(path, parallel, order, admit_late=(), kv_quant="f16", **options):
    """{prompt index: [(token, logits), ...]} of running the prompts in `order` with
    `parallel` slots; those in `admit_late` are added only after three steps. `options` go
    to open_model (io, expert_cache)."""
    from colibri.runtime import open_model

    model = open_model(path, ctx=256, ram_budget="8G", parallel=parallel, kv_quant=kv_quant, **options)
    scheduler = model.scheduler(keep_logits=True)
    texts, index, out = prompts(), {}, {}

    def add(i):
        index[scheduler.add(texts[i], MAX_TOKENS[i], **sampling(i))] = i

    for i in order:
        if i not in admit_late:
            add(i)
    steps = 0
    while scheduler.busy:
        for event in scheduler.step():
            out.setdefault(index[event.sequence], []).append((event.token, event.logits, event.finish_reason))
        steps += 1
        if steps == 3:
            for i in admit_late:
                add(i)
    stats = scheduler.stats()
    model.close()
    return out, stats


def assert_same(alone, together):
    for i in range(len(LENGTHS)):
        assert len(alone[i]) == len(together[i]), i
        for (token, logits, reason), (token2, logits2, reason2) in zip(alone[i], together[i]):
            assert token == token2 and reason == reason2, i
            assert np.array_equal(logits.view(np.uint32), logits2.view(np.uint32)), i


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "deepseek_v3", "qwen3_next", "llama4_text", "kimi_linear",
                                  "minimax_m3_vl_text", "glm5_next_text"])
def test_a_sequence_gets_the_same_logits_alone_and_in_any_batch(models, arch):
    path = models(arch)
    alone = {i: run(path, 1, [i])[0][i] for i in range(len(LENGTHS))}
    # three slots, the last prompts admitted mid-run, in reverse order (other slots)
    three, stats3 = run(path, 3, list(reversed(range(8))), admit_late=(0, 1, 2))
    eight, stats8 = run(path, 8, list(range(8)))
    assert_same(alone, three)
    assert_same(alone, eight)
    assert stats8["rows_per_step"] > 2 and stats3["rows_per_step"] > 1  # the sequences did share steps
    for i in range(len(LENGTHS)):  # every sequence ran to max_tokens or stopped on an end token
        assert len(alone[i]) == MAX_TOKENS[i] or alone[i][-1][2] == "stop"
        assert alone[i][-1][2] in ("stop", "length")


def test_a_batch_gets_the_same_logits_whichever_way_experts_are_read(models):
    """pread into the cache, O_DIRECT, or the files mapped and read in place, with a cache of a
    quarter of the experts (evictions, misses in every step): the same bits."""
    from colibri.formats.layout import ModelLayout

    path = models("qwen3_moe")
    quarter = sum(t.stride * t.count for t in ModelLayout(path).expert_layers.values()) // 4
    runs = {io: run(path, 4, list(range(8)), io=io, expert_cache=quarter) for io in ("pread", "direct", "mmap")}
    assert_same(runs["pread"][0], runs["direct"][0])
    assert_same(runs["pread"][0], runs["mmap"][0])
    for io, (_, stats) in runs.items():
        assert stats["io"] == io and stats["expert_evictions"] > 0 and stats["expert_bytes_read"] > 0


def test_float_weights_and_a_q8_0_cache_are_batch_invariant_too(models):
    path = models("mixtral", "BF16")
    alone = {i: run(path, 1, [i], kv_quant="q8_0")[0][i] for i in range(len(LENGTHS))}
    assert_same(alone, run(path, 4, list(range(8)), kv_quant="q8_0")[0])


def test_a_batch_reads_each_expert_once_per_step(models):
    """With room for every expert, a step's misses are at most its distinct experts: the
    union of the batch's choices, each read once."""
    from colibri.runtime import open_model

    model = open_model(models("mixtral"), ctx=64, ram_budget="8G", parallel=8)
    scheduler = model.scheduler()
    for prompt in prompts():
        scheduler.add(prompt[:20], 2)
    scheduler.step()  # all eight prompts in one step
    stats = scheduler.stats()
    c = model.config
    moe_layers = sum(c.is_moe_layer(i) for i in range(c.n_layers))
    assert stats["expert_misses"] == stats["distinct_experts_per_step"] <= moe_layers * c.n_experts
    assert stats["distinct_experts_per_step"] < sum(len(p[:20]) for p in prompts()) * c.n_experts_used * moe_layers
    model.close()


def test_finished_sequences_free_their_slots_for_queued_ones(models):
    from colibri.runtime import open_model

    model = open_model(models("mixtral"), ctx=64, ram_budget="8G", parallel=2)
    scheduler = model.scheduler()
    ids = [scheduler.add([5 + i, 6, 7], 3) for i in range(5)]
    finished, most_running = [], 0
    while scheduler.busy:
        for event in scheduler.step():
            if event.finish_reason:
                finished.append(event.sequence)
        most_running = max(most_running, len(scheduler.running))
    assert sorted(finished) == ids and most_running == 2 and sorted(scheduler.free) == [0, 1]
    model.close()


def test_cancel_ends_a_queued_or_running_sequence(models):
    from colibri.runtime import open_model

    model = open_model(models("mixtral"), ctx=64, ram_budget="8G", parallel=1)
    scheduler = model.scheduler()
    first, second = scheduler.add([5, 6, 7], 50), scheduler.add([8, 9], 50)
    scheduler.step()
    assert scheduler.cancel(second).finish_reason == "cancelled"  # still queued
    assert scheduler.cancel(first).finish_reason == "cancelled"  # running
    assert scheduler.cancel(first) is None and not scheduler.busy and scheduler.free == [0]
    model.close()


def test_text_generation_of_many_prompts_equals_each_alone(models):
    from colibri.runtime import open_model

    texts = ["The quick brown fox", "Once upon a time", "Numbers: 1, 2, 3", "A"]
    outputs = {}
    for parallel, group in ((1, [[t] for t in texts]), (4, [texts])):
        model = open_model(models("mixtral"), ctx=128, ram_budget="8G", parallel=parallel)
        for batch in group:
            pieces = {}
            for i, piece in model.generate_many(batch, max_tokens=12, temperature=0.7, seed=3):
                pieces[i] = pieces.get(i, "") + piece
            outputs.setdefault(parallel, []).extend(pieces.get(i, "") for i in range(len(batch)))
        model.close()
    assert outputs[1] == outputs[4] and any(outputs[1])


def test_a_stop_string_ends_the_sequence_and_is_not_returned(models):
    from colibri.runtime import open_model

    model = open_model(models("mixtral"), ctx=128, ram_budget="8G")
    free = "".join(piece for _, piece in model.generate_many(["Once upon a time"], max_tokens=20))
    assert len(free) > 4
    stop = free[2:4]
    scheduler = model.scheduler()
    scheduler.add("Once upon a time", 20, stop=[stop])
    events = []
    while scheduler.busy:
        events += scheduler.step()
    assert "".join(e.text for e in events) == free[:free.index(stop)]
    assert events[-1].finish_reason == "stop"
    model.close()


def test_slots_are_in_the_budget(models):
    from colibri.runtime import open_model
    from colibri.runtime.engine import BudgetError

    one = open_model(models("mixtral"), ctx=1024, ram_budget="8G", parallel=1)
    four = open_model(models("mixtral"), ctx=1024, ram_budget="8G", parallel=4)
    assert four.budget.kv == 4 * one.budget.kv and len(four.slots) == 4
    assert sum(s.nbytes for s in four.slots) == four.budget.kv
    with pytest.raises(BudgetError, match="parallel"):
        open_model(models("mixtral"), ctx=1 << 16, ram_budget="8G", parallel=4096)
    one.close()
    four.close()


def documents(folder, count=16):
    folder.mkdir()
    words = "the river mill baker town bell night stone bread road".split()
    rng = np.random.default_rng(5)
    for i in range(count):
        (folder / f"doc{i:02d}.txt").write_text(" ".join(rng.choice(words, 3 + 7 * (i % 5))))
    return folder


def prompt_dir_argv(model, inputs, outputs, parallel, max_tokens):
    return [sys.executable, "-m", "colibri.cli", "run", "--model", str(model), "--prompt-dir", str(inputs),
            "--out-dir", str(outputs), "--parallel", str(parallel), "--max-tokens", str(max_tokens), "--ctx", "512",
            "--temp", "0.7", "--ram-budget", "4G"]


def answers(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if not p.name.startswith(".")}


@pytest.mark.parametrize("sweep", [[], ["--sweep"]], ids=["scheduler", "sweep"])
def test_a_prompt_dir_killed_mid_batch_resumes_with_each_document_answered_once(models, tmp_path, sweep):
    """SIGKILL while documents are in flight, then the same command again: the finished answers
    are kept byte for byte, no partial file is left, and every answer equals an uninterrupted
    run's (with another --parallel: a document's answer does not depend on its company); the
    same for a sweep (`runtime.sweep`), against the scheduler's answers."""
    model = models("qwen3_moe")
    inputs = documents(tmp_path / "in")
    clean = tmp_path / "clean"
    subprocess.run(prompt_dir_argv(model, inputs, clean, 5, 120), check=True, capture_output=True)
    want = answers(clean)
    assert len(want) == 16 and len(set(want.values())) > 1

    out = tmp_path / "out"
    job = subprocess.Popen(prompt_dir_argv(model, inputs, out, 2, 120) + sweep, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and len(list(out.glob("*.out"))) < 3:
        time.sleep(0.005)
    os.kill(job.pid, signal.SIGKILL)
    job.wait()
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.glob("*.out")}
    assert 3 <= len(before) < 16, "the job was not killed mid-batch"
    assert all(want[name] == data for name, (data, _) in before.items())

    done = subprocess.run(prompt_dir_argv(model, inputs, out, 3, 120) + sweep, check=True, capture_output=True, text=True)
    assert f"{16 - len(before)} written, {len(before)} already done, 0 failed" in done.stdout
    assert answers(out) == want  # every document once, none partial
    assert all(p.stat().st_mtime_ns == before[p.name][1] for p in out.glob("*.out") if p.name in before)


def test_a_second_job_on_a_busy_out_dir_is_refused_before_it_touches_anything(models, tmp_path):
    """Two jobs on one --out-dir: the second is refused in one line while the first runs, and
    leaves OUT as it found it (a NAME.partial the first is writing stays); the first finishes
    with every document answered."""
    model = models("qwen3_moe")
    inputs = documents(tmp_path / "in", count=40)  # enough work that the first job outlasts the second's start
    out = tmp_path / "out"
    first = subprocess.Popen(prompt_dir_argv(model, inputs, out, 1, 400), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not list(out.glob("*.out")) and first.poll() is None:
        time.sleep(0.01)  # the first job holds OUT from before its model opens until it ends
    in_flight = out / "doc39.txt.out.partial"  # what the first job's write_answer has beside an answer it writes
    in_flight.write_bytes(b"half an answer")
    second = subprocess.run(prompt_dir_argv(model, inputs, out, 1, 400), capture_output=True, text=True)
    left = in_flight.read_bytes()  # (before the first job reaches doc39, its last, and writes it for real)
    still_running = first.poll() is None
    stdout, _ = first.communicate(timeout=600)
    assert still_running, "the first job ended before the second started"
    assert second.returncode != 0
    assert second.stderr.strip().splitlines() == [f"colibri run: error: --out-dir {out} is in use by another colibri run"]
    assert left == b"half an answer"
    assert first.returncode == 0 and "40 written, 0 already done, 0 failed" in stdout
    assert sorted(p.name for p in out.glob("*.out")) == [f"doc{i:02d}.txt.out" for i in range(40)]


def test_merged_stats_are_the_sums_and_the_step_weighted_means_of_the_parts(models):
    from colibri.runtime.batch import merge_stats
    from colibri.runtime.engine import open_model

    parts = []
    for prompts in (["The river", "A mill"], ["Bells", "Bread and", "The town of"]):
        model = open_model(models("qwen3_moe"), parallel=3, ram_budget="8G", ctx=128)  # (the process's own RSS counts)
        scheduler = model.scheduler()
        for p in prompts:
            scheduler.add(p, max_tokens=4 + len(p) % 3)
        while scheduler.busy:
            scheduler.step()
        parts.append(scheduler.stats())
        model.close()
    merged = merge_stats(parts)
    a, b = parts
    assert merged["steps"] == a["steps"] + b["steps"] and merged["expert_misses"] == a["expert_misses"] + b["expert_misses"]
    assert merged["rows_per_step"] == pytest.approx(
        (a["rows_per_step"] * a["steps"] + b["rows_per_step"] * b["steps"]) / (a["steps"] + b["steps"]))
    assert merged["expert_hit_rate"] == merged["expert_hits"] / (merged["expert_hits"] + merged["expert_misses"])
    assert merged["tok_per_s"] == a["tok_per_s"] + b["tok_per_s"]  # side by side: their rates add
    assert merge_stats([a]) == a
