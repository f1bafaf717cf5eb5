"""Shared fixtures: tiny checkpoints of real architectures, written with numpy only; and CI's
rule that the tests of the optional extras ran."""

import os
import shutil

import pytest

from colibri.convert.synthetic import write_checkpoint

# The commands the tests start compile for this CPU, not for the target `--isa auto` would time
# on each new tiny model (tests/test_isa_choice.py tests that)
os.environ.setdefault("COLIBRI_ISA", "native")


@pytest.fixture
def checkpoint(tmp_path):
    """`checkpoint(arch, **kw)` writes a tiny hub-layout checkpoint and returns its folder."""
    count = 0

    def make(arch="mixtral", **kwargs):
        nonlocal count
        count += 1
        return write_checkpoint(tmp_path / f"src{count}-{arch}", arch, **kwargs)

    return make


@pytest.fixture(scope="module", autouse=True)
def module_scratch_is_removed(tmp_path_factory):
    """Remove the folders a test module made with `tmp_path_factory` once the module is done.

    pytest keeps them to the end of the session, and the suite's tiny models add up to several GB:
    this bounds the run's disk use by its largest module instead.
    """
    root = tmp_path_factory.getbasetemp()
    before = set(root.iterdir())
    yield
    for path in set(root.iterdir()) - before:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


# Skipped on a machine without llama.cpp, Ray Data or Chromium; with COLIBRI_REQUIRE_OPTIONAL=1
# (`make test-ci`, which .ci/run runs) a skip in any of them fails the run.
OPTIONAL_FILES = ("tests/test_llama_cpp.py", "tests/test_ray_batch.py", "tests/test_pages_render.py")


def pytest_sessionfinish(session, exitstatus):
    if os.environ.get("COLIBRI_REQUIRE_OPTIONAL") != "1" or os.environ.get("PYTEST_XDIST_WORKER"):
        return  # (a pytest-xdist worker sees its own files only: the controller checks the whole run)
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
