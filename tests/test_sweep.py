"""Sweeps (`runtime.sweep`): prompts read layer by layer, a window at a time, give each document
the bits it gets alone, and read each layer's experts once for the whole window."""

import subprocess

import numpy as np
import pytest

from test_batch import LENGTHS, MAX_TOKENS, answers, assert_same, documents, models, prompt_dir_argv, prompts, run, sampling  # noqa: F401 (models: a fixture)


def sweep(path, window, scratch=None, **options):
    """{prompt index: [(token, logits, finish reason), ...]} and the stats of a sweep over the
    prompts of `test_batch` with `window` slots (mapped in `scratch` when given)."""
    from colibri.runtime import open_model
    from colibri.runtime.sweep import Sweep

    model = open_model(path, ctx=256, ram_budget="8G", parallel=1 if scratch else window, **options)
    runner = Sweep(model, window, scratch, keep_logits=True)
    index, out = {}, {}
    for i, prompt in enumerate(prompts()):
        index[runner.add(prompt, MAX_TOKENS[i], **sampling(i))] = i
    while runner.busy:
        for event in runner.step():
            out.setdefault(index[event.sequence], []).append((event.token, event.logits, event.finish_reason))
    stats = runner.stats()
    model.close()
    return out, stats


@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v3", "qwen3_next", "gpt_oss", "deepseek_v4", "glm5_next_text"])
def test_a_sweep_gives_each_document_the_bits_it_gets_alone(models, arch, tmp_path):
    """Attention, MLA with its indexer, DeltaNet states, sliding windows, DeepSeek-V4's
    compressors and hyper-connections: a window of all eight prompts, one of three that is
    refilled as documents end, and one whose caches are mapped in a scratch folder."""
    path = models(arch)
    alone = {i: run(path, 1, [i])[0][i] for i in range(len(LENGTHS))}
    for window, scratch in ((8, None), (3, None), (8, tmp_path)):
        together, stats = sweep(path, window, scratch)
        assert_same(alone, together)
        assert stats["prompt_tokens"] == sum(LENGTHS)
    assert list(tmp_path.iterdir()) == []  # the scratch files have no names


def test_a_sweep_reads_each_layers_experts_once_for_all_its_prompts(models):
    """With a cache of a quarter of the experts, the prompts of a window of eight (sixteen
    cuts of up to 64 tokens) read at most every expert once a layer, where the scheduler reads
    experts again in each of its steps."""
    from colibri.formats.layout import ModelLayout
    from colibri.runtime import open_model
    from colibri.runtime.sweep import Sweep

    path = models("mixtral")
    layout = ModelLayout(path)
    quarter = sum(t.stride * t.count for t in layout.expert_layers.values()) // 4
    c = layout.config
    moe_layers = sum(c.is_moe_layer(i) for i in range(c.n_layers))
    misses = {}
    for name in ("sweep", "scheduler"):
        model = open_model(path, ctx=256, ram_budget="8G", parallel=8, expert_cache=quarter)
        runner = Sweep(model) if name == "sweep" else model.scheduler()
        for prompt in prompts():
            runner.add(prompt, 1)
        while runner.busy:
            runner.step()
        misses[name] = runner.stats()["expert_misses"]
        model.close()
    assert misses["sweep"] <= moe_layers * c.n_experts < misses["scheduler"]


def test_sweep_window_and_budget_follow_the_ram_or_the_scratch_space(models, tmp_path, monkeypatch):
    """The window fits the budget (or half the scratch folder's free space), and the model is
    opened with an expert cache that leaves room for the prompt passes' activations."""
    import shutil

    from colibri.formats.layout import ModelLayout
    from colibri.runtime import open_model
    from colibri.runtime.engine import BudgetError, plan_budget
    from colibri.runtime.options import EngineOptions
    from colibri.runtime.memory import current_rss
    from colibri.runtime.sweep import SWEEP_MOST, ffn_block_bytes, hidden_bytes, sweep_options, sweep_window

    path = models("mixtral")
    layout = ModelLayout(path)
    c = layout.config
    options = EngineOptions(ctx=512, ram_budget=current_rss() + (2 << 30))  # this process may hold gigabytes
    assert sweep_window(layout, options.replace(parallel=7), 100, None) == 7
    assert sweep_window(layout, options, 5, None) == 5
    window = sweep_window(layout, options, 10_000, None)
    assert 5 < window <= SWEEP_MOST
    opened = sweep_options(layout, options, window, None)
    budget = plan_budget(layout, 512, "f16", options.ram_budget, None, window)
    assert opened.parallel == window
    held = ffn_block_bytes(c, window * 512) + window * hidden_bytes(c, 512)
    assert opened.expert_cache + held <= budget.ram - budget.fixed
    model = open_model(path, opened)  # the budget takes it
    assert len(model.slots) == window
    model.close()
    assert sweep_options(layout, options, window, tmp_path).parallel == 1
    assert sweep_options(layout, options.replace(expert_cache=1 << 20), window, None).expert_cache == 1 << 20
    fixed = plan_budget(layout, 512, "f16", "64G", None, 40).fixed  # weights, 40 slots and this process
    held = ffn_block_bytes(c, 40 * 512) + 40 * hidden_bytes(c, 512)
    with pytest.raises(BudgetError, match="sweep of 40 documents"):  # room for the slots, not their passes
        sweep_options(layout, options.replace(ram_budget=fixed + held // 2), 40, None)
    monkeypatch.setattr(shutil, "disk_usage", lambda _: shutil._ntuple_diskusage(1 << 40, 0, 100 << 20))
    small = sweep_window(layout, options, 10_000, tmp_path)
    assert 1 <= small < sweep_window(layout, options.replace(ctx=64), 10_000, tmp_path)


def test_a_prompt_dir_sweep_writes_the_answers_of_a_plain_run(models, tmp_path):
    """`colibri run --prompt-dir --sweep`, with and without --scratch: the same files as the
    scheduler's run; and the flags it needs are asked for in one line."""
    model = models("qwen3_moe")
    inputs = documents(tmp_path / "in")
    subprocess.run(prompt_dir_argv(model, inputs, tmp_path / "plain", 4, 24), check=True, capture_output=True)
    want = answers(tmp_path / "plain")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    for out, extra in (("sweep", ["--sweep"]), ("scratch", ["--sweep", "--scratch", str(scratch)])):
        done = subprocess.run(prompt_dir_argv(model, inputs, tmp_path / out, 6, 24) + extra, check=True,
                              capture_output=True, text=True)
        assert "16 written, 0 already done, 0 failed; 6 at a time (sweep)" in done.stdout
        assert answers(tmp_path / out) == want
    argv = prompt_dir_argv(model, inputs, tmp_path / "x", 6, 24)
    for extra, line in ((["--scratch", str(scratch)], "colibri run: error: --scratch needs --sweep"),
                        (["--sweep", "--scratch", str(tmp_path / "missing")],
                         f"colibri run: error: --scratch {tmp_path / 'missing'}: not an existing folder")):
        refused = subprocess.run(argv + extra, capture_output=True, text=True)
        assert refused.returncode != 0 and refused.stderr.strip().splitlines() == [line]
    assert not (tmp_path / "x").exists()


def test_scratch_arrays_are_zeroed_maps_of_nameless_files(tmp_path):
    from colibri.runtime.sweep import scratch_array

    a = scratch_array((3, 5), np.float16, tmp_path)
    assert a.shape == (3, 5) and a.dtype == np.float16 and not a.any()
    a[1] = 2
    assert a.sum() == 10 and list(tmp_path.iterdir()) == []


def test_an_lru_cache_serves_a_sweep_pass_only_when_it_holds_a_whole_pass():
    from colibri.runtime.sweep_plan import lru_hit_rate

    assert lru_hit_rate(0.5, 0.9) == 0 and lru_hit_rate(1.0, 1.0) == 1 and lru_hit_rate(0.3, 0.0) == 1
    assert abs(lru_hit_rate(0.03, 0.001) - 0.03) < 0.001  # sparse passes: the cache's share
    assert lru_hit_rate(0.5, 0.5) == 0.5 and lru_hit_rate(0.9, 0.3) > lru_hit_rate(0.6, 0.3) > 0.3


@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v3"])
def test_the_plan_predicts_a_sweeps_disk_reads_and_scratch(models, arch, tmp_path, monkeypatch):
    """What `colibri plan --docs` says a sweep reads through a quarter-size expert cache (from
    uniform routing, or from the sweep's own routing trace) and maps in --scratch is what the
    sweep then reads and maps."""
    from colibri.formats.layout import ModelLayout
    from colibri.runtime import open_model, sweep
    from colibri.runtime.expert_store import cache_bytes_for_all
    from colibri.runtime.sweep_plan import sweep_estimate, sweep_plan

    path = models(arch)
    layout = ModelLayout(path)
    quarter = cache_bytes_for_all(layout) // 4
    costs = dict.fromkeys(("step_s", "per_expert_s", "per_row_s", "position", "prompt_pass_s", "prompt_token_s",
                           "per_row_position_s"), 0.0)
    docs, doc_tokens, gen_tokens, window = 16, 40, 5, 8
    rng = np.random.default_rng(0)
    mapped = []  # bytes of each scratch map

    def scratch_array(shape, dtype, directory):
        mapped.append(int(np.prod(shape)) * np.dtype(dtype).itemsize)
        return np.zeros(shape, dtype)

    monkeypatch.setattr(sweep, "scratch_array", scratch_array)
    for scratch in (None, tmp_path):
        model = open_model(path, ctx=doc_tokens + gen_tokens, ram_budget="8G", parallel=1 if scratch else window,
                           expert_cache=quarter)
        runner = sweep.Sweep(model, window, scratch)
        caches = len(mapped)  # the window's KV caches; then a prompt pass's hidden states per admission
        trace = {}  # the run's own routing, as `colibri run --trace-routing` writes it
        model.decoder.route_log = lambda layer, positions, ids, weights: \
            trace.setdefault(layer, []).extend(frozenset(map(int, row)) for row in ids)
        for _ in range(docs):
            runner.add(rng.integers(3, 200, doc_tokens).tolist(), gen_tokens, ignore_eos=True)
        while runner.busy:
            runner.step()
        read = runner.stats()["expert_bytes_read"]
        model.close()
        if scratch is None:
            for routing in (None, trace):
                predicted = sweep_estimate(layout, costs, docs, doc_tokens, gen_tokens, window, model.store.cache_bytes,
                                           1e9, routing)
                assert 0.9 < read / predicted["bytes_read"] < 1.1
    planned = sweep_plan(layout, costs, 1e9, docs, doc_tokens, gen_tokens, 8 << 30, "f16", parallel=window,
                         scratch=tmp_path)
    assert planned["fits"] and planned["window"] == window and len(mapped) == caches + 2
    assert planned["scratch_bytes"] == sum(mapped[:caches]) + max(mapped[caches:])


def test_a_sweeps_plan_overlaps_its_prompt_pass_with_its_reads_and_adds_its_decode_steps_reads(models):
    """A prompt pass takes the longer of its compute and its expert reads (the store reads a
    layer's experts while its tokens run); each decode step adds its reads to its compute."""
    from colibri.formats.layout import ModelLayout
    from colibri.runtime.sweep_plan import sweep_estimate, window_compute, window_reads

    layout = ModelLayout(models("mixtral"))
    costs = dict.fromkeys(("step_s", "per_expert_s", "position", "prompt_pass_s", "per_row_position_s"), 0.0)
    costs.update(prompt_token_s=1e-3, per_row_s=2e-3)
    prompts = {}
    for disk_bw in (1e12, 1e6):  # compute-bound, then disk-bound
        prompts[disk_bw] = estimate = sweep_estimate(layout, costs, 8, 40, 1, 8, 0, disk_bw)
        assert estimate["seconds"] == pytest.approx(max(estimate["compute_s"], estimate["disk_s"]))
    assert prompts[1e12]["seconds"] == pytest.approx(0.32) and prompts[1e6]["seconds"] > 0.32
    decoding = sweep_estimate(layout, costs, 8, 40, 6, 8, 0, 1e6)
    _, decode_read = window_reads(layout, 8, 40, 6, 0.0)
    _, decode_s = window_compute(layout, costs, 8, 40, 6)
    assert decode_s == pytest.approx(5 * 8 * 2e-3) and decode_read > 0
    assert decoding["seconds"] - prompts[1e6]["seconds"] == pytest.approx(decode_s + decode_read / 1e6)


def test_the_decode_cost_fit_leaves_out_a_term_that_would_be_negative():
    """`plan.nonnegative_fit`: steps whose fixed cost fits below zero (here -3 ms, as short
    noisy steps gave it) are fitted by the other two terms alone, not by the free fit with its
    intercept then cut to 0, which would predict every step too slow; a free fit whose terms
    are all positive is kept as it is."""
    from colibri.runtime.plan import nonnegative_fit

    rng = np.random.default_rng(0)
    rows = rng.integers(1, 129, 40).astype(float)
    distinct = 16 * 32 * (1 - (1 - 4 / 32) ** rows)  # 16 layers of 32 experts, top-4
    design = np.column_stack([np.ones_like(rows), distinct, rows])
    negative = design @ [-3e-3, 0.15e-3, 4.7e-3]
    a, b, c = nonnegative_fit(design, negative)
    alone = np.linalg.lstsq(design[:, 1:], negative, rcond=None)[0]
    assert a == 0 and np.allclose((b, c), alone) and b > 0 and c > 0
    cut = np.linalg.lstsq(design, negative, rcond=None)[0].clip(0)
    assert np.abs(design @ [a, b, c] - negative).sum() < np.abs(design @ cut - negative).sum()
    positive = design @ [2e-3, 0.15e-3, 4.7e-3]
    assert np.allclose(nonnegative_fit(design, positive), [2e-3, 0.15e-3, 4.7e-3])


def test_a_sweep_whose_expansion_budget_runs_out_gives_the_bits_of_one_that_keeps_them(models, monkeypatch):
    """MLA's kept prompt expansions (`runtime.kept_expansions`) within a budget that holds some
    of a window's, not all: the documents left without one expand their cuts again, to the
    same bits as alone, where every expansion is kept."""
    from colibri.runtime import model as model_module

    path = models("deepseek_v3")
    alone = {i: run(path, 1, [i])[0][i] for i in range(len(LENGTHS))}
    monkeypatch.setattr(model_module, "EXPANDED_MLA_KEEP_BYTES", 200 << 10)
    together, _ = sweep(path, 8)
    assert_same(alone, together)


def test_prompts_run_in_groups_whose_kept_expansions_fit_the_budget():
    from colibri.runtime.sweep import _groups

    lengths = np.array([100, 300, 50, 400, 10])
    assert [g.tolist() for g in _groups(lengths, 0, 0)] == [[0, 1, 2, 3, 4]]  # nothing kept: one run
    assert [g.tolist() for g in _groups(lengths, 1, 450)] == [[0, 1, 2], [3, 4]]
    assert [g.tolist() for g in _groups(lengths, 1, 10)] == [[0], [1], [2], [3], [4]]  # a prompt past it runs alone
