"""The layers the design draws hold: an ast walk over every source file fails the suite when an
import crosses a line, or when a module reaches for another module's private names.

    formats       imports nothing of ours
    convert       formats
    runtime       formats
    verify        formats, runtime, and the converter's architecture knowledge (see VERIFY_USES)
    colibri.cli   (the command line) everything

The top of `colibri/` holds only leaves every layer may read (`colibri.version`,
`colibri.kernel_cache`: they import nothing of ours) and the documented re-exports
(`colibri.open_model`, lazily; `colibri.ray_batch`). The benchmark scripts of `bench/` may
import anything of ours, and each other without a cycle; nothing of ours imports them.
"""

from __future__ import annotations

import ast
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
FOLDERS = {"formats": "colibri.formats", "convert": "colibri.convert", "runtime": "colibri.runtime",
           "verify": "colibri.verify", "colibri": "colibri"}
LEAVES = ("colibri.version", "colibri.kernel_cache")
RE_EXPORTS = {"colibri": ("colibri.runtime",), "colibri.ray_batch": ("colibri.cli.ray_batch",)}

# verify-source asks "would this checkpoint convert?" and verify asks "are these the tensors this
# config implies?": both answer with the converter's own adapters and planner, so that what a model
# must hold is defined once.
VERIFY_USES = ("colibri.convert.arch", "colibri.convert.plan")

ALLOWED = {
    "colibri.formats": ("colibri.formats",),
    "colibri.convert": ("colibri.formats", "colibri.convert"),
    "colibri.runtime": ("colibri.formats", "colibri.runtime"),
    "colibri.verify": ("colibri.formats", "colibri.runtime", "colibri.verify") + VERIFY_USES,
    "colibri.cli": ("colibri",),
}


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def module_name(path: pathlib.Path) -> str:
    """The import name of a source file: runtime/kernels.py -> colibri.runtime.kernels."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    package = FOLDERS[parts[0]]
    rest = [p for p in parts[1:] if p != "__init__"]
    return ".".join([package, *rest])


def sources() -> list[pathlib.Path]:
    return sorted(p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py"))


def imports(path: pathlib.Path, module: str):
    """(line, imported module, names) for every import of ours in `path`, relative ones resolved."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, ()
        elif isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:
                base = module.split(".")[: len(module.split(".")) - node.level + is_package]
                target = ".".join(base + ([target] if target else []))
            yield node.lineno, target, tuple(a.name for a in node.names)


def crossings(path: pathlib.Path) -> list[str]:
    """Why each import of `path` crosses a layer or reaches a private name ([] when none does)."""
    module = module_name(path)
    layer = module if module in RE_EXPORTS else next((p for p in ALLOWED if _within(module, p)), None)
    allowed = RE_EXPORTS[module] if module in RE_EXPORTS else ALLOWED.get(layer, ())
    problems = []
    for line, target, names in imports(path, module):
        if not _within(target, "colibri"):
            continue
        where = f"{path.relative_to(ROOT)}:{line}"
        modules = [target] + [f"{target}.{n}" for n in names]
        if module in LEAVES:
            problems.append(f"{where}: {module} imports {target}")
        elif layer and not any(_within(m, leaf) for m in modules for leaf in LEAVES):
            if not any(_within(m, reached) for m in modules for reached in allowed):
                problems.append(f"{where}: {layer} imports {target}")
        private = [n for n in names if n.startswith("_") and not n.startswith("__")]
        if private and not _within(module, target):
            problems.append(f"{where}: imports private {', '.join(private)} of {target}")
    return problems


def test_every_source_file_is_walked():
    walked = {module_name(p) for p in sources()}
    assert {"colibri.formats.layout", "colibri.convert.pipeline", "colibri.runtime.engine",
            "colibri.verify.model_check", "colibri.cli.commands"} <= walked


def test_the_top_of_colibri_holds_only_leaves_and_re_exports():
    top = {module_name(p) for p in (ROOT / "colibri").glob("*.py")}
    assert top == {*LEAVES, *RE_EXPORTS}


@pytest.mark.parametrize("path", sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_stay_in_their_layer(path):
    assert crossings(path) == []


def test_a_crossing_is_caught(tmp_path, monkeypatch):
    """The walk itself: a runtime module importing the converter, a private name, formats importing up."""
    for folder in ("runtime", "formats"):
        (tmp_path / folder).mkdir()
    bad_runtime = tmp_path / "runtime" / "bad.py"
    bad_runtime.write_text("from colibri.convert.plan import make_plan\nfrom colibri.runtime.kernels import _share\n")
    bad_formats = tmp_path / "formats" / "bad.py"
    bad_formats.write_text("from ..runtime import memory\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert crossings(bad_runtime) == ["runtime/bad.py:1: colibri.runtime imports colibri.convert.plan",
                                      "runtime/bad.py:2: imports private _share of colibri.runtime.kernels"]
    assert crossings(bad_formats) == ["formats/bad.py:1: colibri.formats imports colibri.runtime"]
    (tmp_path / "runtime" / "other.py").write_text("from colibri.formats.layout import _private\n")
    assert crossings(tmp_path / "runtime" / "other.py") == [
        "runtime/other.py:1: imports private _private of colibri.formats.layout"]


def bench_imports() -> dict[str, set[str]]:
    """For each script of bench/, the other scripts it imports (a script's folder is first on
    sys.path, so `from decode import run` is bench/decode.py)."""
    scripts = {p.stem: p for p in (ROOT / "bench").glob("*.py")}
    return {name: {target.split(".")[0] for _, target, _ in imports(path, name)} & set(scripts) - {name}
            for name, path in scripts.items()}


def cycle(graph: dict[str, set[str]]) -> list[str]:
    """A cycle of `graph` (each node's successors) as its nodes in order, [] when there is none."""
    done, path = set(), []

    def visit(node):
        if node in path:
            return path[path.index(node):] + [node]
        if node in done:
            return []
        path.append(node)
        for following in sorted(graph[node]):
            if found := visit(following):
                return found
        path.pop()
        done.add(node)
        return []

    return next((found for node in sorted(graph) if (found := visit(node))), [])


def test_bench_scripts_import_each_other_without_a_cycle():
    graph = bench_imports()
    assert {"decode", "batch", "compare"} <= set(graph) and graph["compare"]  # the walk sees their imports
    assert cycle(graph) == []
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]  # and finds one


@pytest.mark.parametrize("path", sorted((ROOT / "bench").glob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_bench_scripts_use_only_public_names(path):
    private = [f"{path.name}:{line}: {target}.{n}" for line, target, names in imports(path, path.stem)
               if _within(target, "colibri") for n in names if n.startswith("_") and not n.startswith("__")]
    assert private == []


def test_nothing_of_ours_imports_a_bench_script():
    scripts = {p.stem for p in (ROOT / "bench").glob("*.py")}
    reached = [f"{p.relative_to(ROOT)}: {target}" for p in sources() for _, target, _ in imports(p, module_name(p))
               if target.split(".")[0] in scripts]
    assert reached == []


MOST_KERNEL_PARAMETERS = 8  # a kernel takes a layer's records (named tuples), not their fields one by one


def kernel_widths() -> dict[str, int]:
    """The parameter count of every numba-compiled function defined in the package's layers."""
    import importlib
    import inspect

    from numba.core.registry import CPUDispatcher

    widths = {}
    for path in sources():
        module = module_name(path)
        if _within(module, "colibri.cli") or not any(_within(module, layer) for layer in ALLOWED):
            continue  # the command line compiles nothing (and its __main__ would run)
        for name, value in vars(importlib.import_module(module)).items():
            if isinstance(value, CPUDispatcher) and value.py_func.__module__ == module:
                widths[f"{module}.{name}"] = len(inspect.signature(value.py_func).parameters)
    return widths


def test_no_kernel_takes_more_than_eight_parameters():
    widths = kernel_widths()
    assert {"colibri.runtime.fused._routed_tail_kernel", "colibri.runtime.kernels.experts.moe_steps",
            "colibri.runtime.kernels.attention._attend"} <= set(widths)  # the walk finds the kernels
    assert {name: n for name, n in widths.items() if n > MOST_KERNEL_PARAMETERS} == {}
