"""`--io mmap`: expert files mapped and read in place, inside the expert-cache budget, and warm
for the next process."""

import importlib
import os
import subprocess
import sys

import numpy as np
import pytest

from colibri.convert.hf_to_colibri import ConvertOptions, convert
from colibri.formats.layout import ModelLayout


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from colibri.convert.synthetic import write_checkpoint

    root = tmp_path_factory.mktemp("mapped")
    convert(str(write_checkpoint(root / "src", "qwen3_moe")), root / "model", ConvertOptions(quant="Q4_K_M", progress=False))
    return root / "model"


def evict(path):
    """Drop the model's expert files from the page cache (written back first)."""
    layout = ModelLayout(path)
    for table in layout.expert_layers.values():
        fd = os.open(layout.path(table.file), os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def all_experts(path):
    return sum(t.stride * t.count for t in ModelLayout(path).expert_layers.values())


def test_mapped_experts_stay_inside_the_budget_over_a_long_run(model, monkeypatch):
    from colibri.runtime import open_model
    from colibri.runtime.memory import current_rss

    attention = importlib.import_module("colibri.runtime.kernels.attention")  # the module (kernels.attention is its function)
    evict(model)
    m = open_model(model, ctx=2100, ram_budget="8G", expert_cache=all_experts(model) // 4, io="mmap")
    try:
        token = int(np.argmax(m.prefill([5, 9, 2, 7])[-1]))
        with monkeypatch.context() as patch:  # the threaded attention too, which longer contexts take
            patch.setattr(attention, "PARALLEL_ATTENTION_WORK", 0)
            token = int(np.argmax(m.decode(token)))
        token = int(np.argmax(m.decode(token)))  # the kernels compiled, their scratch allocated
        budget, rss = m.store.cache_bytes, current_rss()
        most = 0
        for step in range(2000):
            token = int(np.argmax(m.decode(token)))
            if step % 50 == 0:
                most = max(most, m.store.resident_bytes())
        stats = m.stats()
        assert stats["expert_evictions"] > 0 and stats["expert_misses"] > 0
        assert 0 < most <= budget and stats["expert_resident_bytes"] <= budget
        assert current_rss() - rss <= budget + (16 << 20)  # mapped pages in RSS too: the budget, no copy beside
        assert stats["expert_cache_bytes"] == budget and stats["io"] == "mmap"
    finally:
        m.close()


def test_without_an_expert_cache_only_the_last_fetch_stays_mapped(model):
    from colibri.runtime import open_model

    m = open_model(model, ctx=256, ram_budget="8G", expert_cache=0, io="mmap")
    try:
        token = int(np.argmax(m.prefill([5, 9, 2, 7])[-1]))
        for _ in range(100):
            token = int(np.argmax(m.decode(token)))
        assert m.store.index.capacity == 0 and m.stats()["expert_misses"] > 0
        assert m.store.resident_bytes() <= m.config.n_experts_used * m.store.slot_bytes
    finally:
        m.close()


def test_a_restarted_process_finds_the_mapped_experts_warm(model):
    """A process killed without closing leaves its experts in the page cache; the next one
    finds them in the page cache before it reads anything."""
    from colibri.runtime import open_model

    evict(model)
    first = ("import os, sys\nfrom colibri.runtime import open_model\n"
             "m = open_model(sys.argv[1], ctx=64, ram_budget='8G', io='mmap')\n"
             "m.prefill(list(range(3, 40)))\nprint(m.store.cached_bytes(), flush=True)\nos._exit(9)\n")
    done = subprocess.run([sys.executable, "-c", first, str(model)], capture_output=True, text=True)
    assert done.returncode == 9, done.stderr
    held = int(done.stdout)
    m = open_model(model, ctx=64, ram_budget="8G", io="mmap")
    try:
        assert held > 0 and m.store.cached_bytes() >= held and m.stats()["expert_bytes_read"] == 0
        assert m.store.resident_bytes() == 0  # in the page cache, not yet mapped into this process
    finally:
        m.close()


def test_a_short_expert_file_is_refused_for_mapping_with_one_line(model, tmp_path):
    import shutil

    from colibri.formats.layout import write_manifest
    from colibri.runtime import open_model

    copy = tmp_path / "short"
    shutil.copytree(model, copy)
    layout = ModelLayout(copy)
    table = next(iter(layout.expert_layers.values()))
    # a page of padding after each record but the last: the layout allows it, a mapping does not
    path, stride = layout.path(table.file), table.stride + 4096
    data = path.read_bytes()
    records = [data[table.expert_offset(e):table.expert_offset(e) + table.expert_bytes] for e in range(table.count)]
    path.write_bytes(b"".join(r + bytes(stride - len(r)) for r in records[:-1]) + records[-1])
    entry = next(e for e in layout.manifest["expert_layers"] if e["layer"] == table.layer)
    entry["stride"] = stride
    layout.manifest["files"][table.file]["size"] = path.stat().st_size
    write_manifest(copy, layout.manifest)
    with pytest.raises(OSError, match="mapping needs whole page-aligned records") as error:
        open_model(copy, ctx=64, ram_budget="8G", io="mmap")
    assert "\n" not in str(error.value) and str(layout.path(table.file)) in str(error.value)
