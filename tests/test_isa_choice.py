"""`--isa`: the kernels' target chosen by timing them (runtime/isa_choice.py, runtime/isa_probe.py)
and settled before the run (cli/isa_flag.py)."""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from colibri.cli import isa_flag
from colibri.convert.hf_to_colibri import ConvertOptions, convert
from colibri.convert.synthetic import write_checkpoint
from colibri.formats.layout import ModelLayout
from colibri.runtime import isa_choice


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("isa")
    src = write_checkpoint(root / "src", "qwen3_moe")
    convert(str(src), root / "model", ConvertOptions(quant="Q4_K_M", progress=False))
    return root / "model"


def test_matrix_kinds_count_the_experts_a_token_reads(model_dir):
    layout = ModelLayout(model_dir)
    kinds = isa_choice.matrix_kinds(layout)
    tensors = {s[1] for k in kinds for s in k.sources if s[0] == "tensor"}
    assert "token_embd.weight" not in tensors and "output.weight" in tensors  # a lookup, and the head
    assert all(len(layout.tensors[name].shape) == 2 for name in tensors)
    experts = sum(t.expert_bytes * layout.config.n_experts_used for t in layout.expert_layers.values())
    assert sum(k.bytes_per_token for k in kinds) == sum(layout.tensors[name].nbytes for name in tensors) + experts
    assert len({k.key for k in kinds}) == len(kinds)


def test_native_stays_unless_another_target_is_clearly_faster():
    assert isa_choice.decide({"native": 1.0, "avx2": 0.99}) == "native"
    assert isa_choice.decide({"native": 1.0, "avx2": 0.9}) == "avx2"
    assert isa_choice.decide({"native": 0.9, "avx2": 1.0}) == "native"


def test_choose_times_each_target_in_a_process_of_its_own_then_keeps_the_answer(model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(isa_choice, "candidates", lambda: ["native", "avx2"])
    cache = tmp_path / "choices.json"
    heard = []
    choice = isa_choice.choose(model_dir, 1, cache=cache, report=heard.append)
    assert not choice.cached and len(heard) == 1 and str(cache) in heard[0]
    assert set(choice.seconds_per_token) == {"native", "avx2"} and all(s > 0 for s in choice.seconds_per_token.values())
    assert choice.target == isa_choice.decide(choice.seconds_per_token)
    assert list(json.loads(cache.read_text()).values())[0]["target"] == choice.target

    def no_workers(*args, **kwargs):
        raise AssertionError("a cached choice started a worker")

    monkeypatch.setattr(subprocess, "Popen", no_workers)
    again = isa_choice.choose(model_dir, 1, cache=cache, report=heard.append)
    assert again.cached and again.target == choice.target and len(heard) == 1
    with pytest.raises(AssertionError, match="started a worker"):  # other threads: another key
        isa_choice.choose(model_dir, 2, cache=cache)


def test_a_damaged_cache_is_timed_again_not_trusted(tmp_path):
    cache = tmp_path / "choices.json"
    for text in ("{not json", "[1, 2]", json.dumps({"k": {"target": "rm -rf", "seconds_per_token": {}}}),
                 json.dumps({"k": {"target": "avx2", "seconds_per_token": {"avx2": "fast"}}})):
        cache.write_text(text)
        assert isa_choice._cached_choice(isa_choice._read_cache(cache).get("k")) is None
    cache.write_bytes(b" " * (isa_choice.MAX_CACHE_BYTES + 1))
    assert isa_choice._read_cache(cache) == {}


def test_a_worker_that_fails_is_named_in_one_line(model_dir, tmp_path):
    kinds = isa_choice.matrix_kinds(ModelLayout(model_dir))
    with pytest.raises(isa_choice.IsaError, match="timing the kernels built for native failed: .*colibri.json"):
        isa_choice.time_targets(tmp_path / "gone", ["native"], 1, kinds)


class Restarted(Exception):
    pass


@pytest.fixture
def settle(monkeypatch, model_dir):
    """settle_isa(isa, restartable) on the tiny model, with os.execve caught: (target, argv, env)
    of a restart come back in a Restarted."""
    for name in ("NUMBA_CPU_NAME", "NUMBA_CPU_FEATURES", isa_flag.ENV):
        monkeypatch.delenv(name, raising=False)

    def execve(path, argv, env):
        raise Restarted(path, argv, env)

    monkeypatch.setattr(os, "execve", execve)
    return lambda isa, restartable=True: isa_flag.settle_isa(
        SimpleNamespace(isa=isa, model=str(model_dir), threads=1, restartable=restartable), "run")


def test_another_target_runs_the_same_command_again_compiling_for_it(settle, monkeypatch):
    with pytest.raises(Restarted) as restart:
        settle("avx2")
    path, argv, env = restart.value.args
    assert path == sys.executable and argv == [sys.executable, *sys.orig_argv[1:]]
    assert env["NUMBA_CPU_NAME"] == "haswell" and "-avx512f" in env["NUMBA_CPU_FEATURES"].split(",")
    monkeypatch.setenv("NUMBA_CPU_NAME", "haswell")
    monkeypatch.setenv("NUMBA_CPU_FEATURES", env["NUMBA_CPU_FEATURES"])
    assert settle("avx2") == "avx2"  # the restarted process goes on
    assert settle("auto") == "avx2"  # whoever set NUMBA_CPU_NAME chose
    with pytest.raises(Restarted) as restart:
        settle("native")
    assert "NUMBA_CPU_NAME" not in restart.value.args[2] and "NUMBA_CPU_FEATURES" not in restart.value.args[2]


def test_auto_follows_the_timed_choice(settle, monkeypatch):
    chosen = []
    monkeypatch.setattr(isa_flag, "choose", lambda model, threads, report: chosen.append(model) or
                        isa_choice.IsaChoice("avx2", {"native": 2.0, "avx2": 1.0}, cached=False))
    with pytest.raises(Restarted):
        settle("auto")
    assert settle("auto", restartable=False) == "native" and len(chosen) == 1  # in-process: no timing
    monkeypatch.setenv(isa_flag.ENV, "native")
    assert settle(None) == "native" and len(chosen) == 1
    monkeypatch.setenv(isa_flag.ENV, "avx9")
    with pytest.raises(SystemExit, match=r"\$COLIBRI_ISA='avx9' unknown"):
        settle(None)


def test_a_target_an_in_process_command_cannot_take_is_refused(settle):
    with pytest.raises(SystemExit, match="--isa avx2 needs a process of its own"):
        settle("avx2", restartable=False)
    assert settle("native", restartable=False) == "native"


def test_a_failed_timing_keeps_the_processs_target(settle, monkeypatch, capsys):
    def fails(model, threads, report):
        raise isa_choice.IsaError("timing the kernels built for avx2 failed: boom")

    monkeypatch.setattr(isa_flag, "choose", fails)
    assert settle("auto") == "native"
    assert "failed: boom; the kernels stay native" in capsys.readouterr().err
