"""numba's cache files are dropped when the sources the kernels are built from change."""

from colibri import kernel_cache


def test_cache_files_go_when_a_source_changes(tmp_path, monkeypatch):
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    source, cache = tmp_path / "emitter.py", tmp_path / "__pycache__"
    source.write_text("IR = 1\n")
    cache.mkdir()
    compiled = [cache / "rows.row_dot-12.py311.nbi", cache / "rows.row_dot-12.py311.1.nbc"]
    for path in compiled:
        path.write_bytes(b"old machine code")
    (cache / "rows.cpython-311.pyc").write_bytes(b"python's own")
    assert kernel_cache.drop_if_stale("runtime", [source], [cache])  # no stamp yet: dropped
    assert not any(p.exists() for p in compiled) and (cache / "rows.cpython-311.pyc").exists()
    for path in compiled:
        path.write_bytes(b"new machine code")
    assert not kernel_cache.drop_if_stale("runtime", [source], [cache])  # same sources: kept
    assert all(p.exists() for p in compiled)
    source.write_text("IR = 2\n")
    assert kernel_cache.drop_if_stale("runtime", [source], [cache])
    assert not any(p.exists() for p in compiled)


def test_a_custom_numba_cache_dir_is_left_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "elsewhere"))
    (tmp_path / "k.nbi").write_bytes(b"x")
    (tmp_path / "s.py").write_text("")
    assert not kernel_cache.drop_if_stale("runtime", [tmp_path / "s.py"], [tmp_path])
    assert (tmp_path / "k.nbi").exists()
