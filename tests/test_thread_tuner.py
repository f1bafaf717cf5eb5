"""`--threads auto`: the tuner's rounds of trials, the flag, and the same tokens at any count."""

import numpy as np
import pytest

from colibri.cli import main
from colibri.convert.hf_to_colibri import ConvertOptions, convert
from colibri.convert.synthetic import write_checkpoint
from colibri.runtime import open_model
from colibri.runtime.kernels import most_threads, set_threads, thread_count
from colibri.runtime.options import EngineOptions, OptionError
from colibri.runtime.thread_tuner import ThreadTuner


def run_steps(tuner: ThreadTuner, steps: int, seconds_at) -> list[int]:
    """The counts `steps` decode steps ran on, each taking `seconds_at(count)`."""
    counts = []
    for _ in range(steps):
        count = tuner.count()
        tuner.timed(count, seconds_at(count))
        counts.append(count)
    return counts


def test_each_round_tries_every_count_then_keeps_the_fastest():
    tuner = ThreadTuner(2, period=16, trial=3)
    counts = run_steps(tuner, 16, {1: 0.010, 2: 0.005}.get)  # a quiet machine: two threads are faster
    assert counts == [1, 1, 1, 2, 2, 2] + [2] * 10 and tuner.best == 2
    counts = run_steps(tuner, 16, {1: 0.012, 2: 0.030}.get)  # a core taken: one thread is faster
    assert counts == [1, 1, 1, 2, 2, 2] + [1] * 10 and tuner.best == 1


def test_fewer_threads_must_be_clearly_faster():
    tuner = ThreadTuner(4, period=16, trial=1)
    run_steps(tuner, 4, {1: 0.0100, 2: 0.0104, 3: 0.0108, 4: 0.0120}.get)  # within 10%: noise, keep more threads
    assert tuner.best == 3


def test_many_cores_try_a_few_counts():
    assert ThreadTuner(16).candidates == [8, 15, 16] and ThreadTuner(4).candidates == [1, 2, 3, 4]
    assert ThreadTuner(1).candidates == [1]


def test_one_slow_step_does_not_decide():
    tuner = ThreadTuner(2, period=8, trial=3)
    times = iter([0.010, 0.500, 0.010, 0.020, 0.020, 0.020])  # a count-1 step stalled once
    run_steps(tuner, 6, lambda count: next(times))
    assert tuner.best == 1  # medians: 10 ms against 20 ms


def test_the_flag_takes_a_count_or_auto_the_default():
    assert EngineOptions().threads == "auto" and EngineOptions(threads=3).threads == 3
    for bad in (0, "all"):
        with pytest.raises(OptionError, match="--threads must be at least 1 or auto"):
            EngineOptions(threads=bad)


@pytest.fixture
def threads_kept():
    """The kernels' thread count as it was before the test (a tuner leaves its last choice set)."""
    before = thread_count()
    yield
    set_threads(before)


def test_auto_threads_decode_the_same_bits(tmp_path, capsys, threads_kept):
    src = write_checkpoint(tmp_path / "src", "deepseek_v3")
    convert(str(src), tmp_path / "model", ConvertOptions(quant="Q4_K_M", progress=False))
    ids = [int(t) for t in np.random.default_rng(0).integers(0, 500, 20)]
    runs = {}
    for threads in (2, "auto"):
        model = open_model(tmp_path / "model", threads=threads, ctx=128, ram_budget="8G")
        logits = [model.prefill(ids)[-1]]
        for _ in range(12):  # the first round of trials: 4 steps on one thread, 4 on two, then the best
            logits.append(model.decode(int(np.argmax(logits[-1]))))
        runs[threads] = np.stack(logits)
        assert model.stats()["threads"] in (1, 2)
        model.close()
        batched = open_model(tmp_path / "model", threads=threads, ctx=128, ram_budget="8G", parallel=3)
        texts = {}
        for i, piece in batched.generate_many([ids[:5], ids[5:12], ids], max_tokens=12):  # decode steps of 3 rows
            texts[i] = texts.get(i, "") + piece
        runs[threads, "batched"] = texts
        batched.close()
    assert len(runs[2, "batched"]) == 3 and runs[2, "batched"] == runs["auto", "batched"]
    assert np.array_equal(runs[2], runs["auto"])
    code = main(["run", "--model", str(tmp_path / "model"), "--prompt", "The river", "--max-tokens", "4",
                 "--threads", "auto", "--ram-budget", "8G"])
    assert code == 0, capsys.readouterr().err


def test_auto_is_the_default_tunes_over_every_core_and_leaves_the_best_set(tmp_path, threads_kept):
    src = write_checkpoint(tmp_path / "src", "qwen3_moe")
    convert(str(src), tmp_path / "model", ConvertOptions(quant="Q4_K_M", progress=False))
    open_model(tmp_path / "model", threads=1, ctx=64, ram_budget="8G").close()  # leaves the kernels on one thread
    model = open_model(tmp_path / "model", ctx=64, ram_budget="8G")
    assert model.tuner.candidates == ThreadTuner(most_threads()).candidates
    model.prefill([1, 2, 3])
    model.decode(4)  # a trial step, on the fewest threads
    assert thread_count() == model.tuner.best == most_threads()  # a batch step after it runs on the best
    model.close()
