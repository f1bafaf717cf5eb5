"""Shared fixtures: tiny checkpoints of real architectures, written with numpy only."""

import pytest

from colibri.convert.synthetic import write_checkpoint


@pytest.fixture
def checkpoint(tmp_path):
    """`checkpoint(arch, **kw)` writes a tiny hub-layout checkpoint and returns its folder."""
    count = 0

    def make(arch="mixtral", **kwargs):
        nonlocal count
        count += 1
        return write_checkpoint(tmp_path / f"src{count}-{arch}", arch, **kwargs)

    return make
