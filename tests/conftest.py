"""Shared fixtures: tiny checkpoints of real architectures, written with numpy only; and CI's
rule that the tests of the optional extras ran."""

import os

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


# Skipped on a machine without llama.cpp, Ray Data or Chromium; with COLIBRI_REQUIRE_OPTIONAL=1
# (`make test-ci`, which .ci/run runs) a skip in any of them fails the run.
OPTIONAL_FILES = ("tests/test_llama_cpp.py", "tests/test_ray_batch.py", "tests/test_pages_render.py")


def pytest_sessionfinish(session, exitstatus):
    if os.environ.get("COLIBRI_REQUIRE_OPTIONAL") != "1":
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    whole_suite = not session.config.getoption("file_or_dir")
    passed = {r.nodeid.split("::")[0] for r in reporter.stats.get("passed", [])}
    problems = [f"{r.nodeid} was skipped: {r.longrepr[-1] if isinstance(r.longrepr, tuple) else r.longrepr}"
                for r in reporter.stats.get("skipped", []) if r.nodeid.split("::")[0] in OPTIONAL_FILES]
    problems += [f"no test of {name} passed" for name in OPTIONAL_FILES if whole_suite and name not in passed]
    for problem in problems:
        reporter.write_line(f"COLIBRI_REQUIRE_OPTIONAL: {problem}")
    if problems:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
