"""The distribution: one import package, `colibri`, whose parts keep their folders at the top of
the repository; a wheel carries all of them and nothing else."""

from __future__ import annotations

import importlib.metadata
import pathlib
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SETUPTOOLS = PYPROJECT["tool"]["setuptools"]


def folder_of(package: str) -> pathlib.Path:
    """Where setuptools finds `package` under the project's package-dir mapping."""
    mapping = SETUPTOOLS["package-dir"]
    parent = max((p for p in mapping if package == p or package.startswith(p + ".")), key=len)
    return ROOT / mapping[parent] / pathlib.Path(*package[len(parent):].split(".")[1:])


def test_every_source_package_is_listed():
    listed = set(SETUPTOOLS["packages"])
    assert all(p == "colibri" or p.startswith("colibri.") for p in listed)
    found = set()
    for package, folder in SETUPTOOLS["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rest = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((package, *rest)))
    assert found == listed
    assert all((folder_of(p) / "__init__.py").is_file() for p in listed)


def test_the_top_package_is_light_and_opens_models():
    code = ("import sys, colibri, colibri.formats.layout; assert 'numba' not in sys.modules, 'numba imported'; "
            "from colibri import open_model; from colibri.runtime.engine import open_model as o; "
            "assert open_model is o; print(colibri.__version__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()


def test_a_wheel_adds_one_top_level_package(tmp_path):
    source = tmp_path / "src"
    for folder in {*SETUPTOOLS["package-dir"].values()}:
        shutil.copytree(ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path / "wheel"), str(source)], check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp_path / "wheel").glob("*.whl")
    assert wheel.name.startswith("colibri_moe-")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        z.extractall(tmp_path / "site")
    assert {n.split("/")[0] for n in names} == {"colibri", wheel.name.split("-py")[0] + ".dist-info"}
    assert "colibri/formats/manifest.schema.json" in names and "colibri/runtime/engine.py" in names
    code = ("import colibri.formats.layout, colibri.verify.model_check; print(colibri.formats.layout.__file__); "
            "import importlib.util as u; print([m for m in ('formats', 'convert', 'runtime', 'verify') if u.find_spec(m)])")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(tmp_path / "site"), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    where, top_level = out.stdout.split()
    assert pathlib.Path(where).is_relative_to(tmp_path / "site")
    assert top_level == "[]"


def test_no_script_or_test_module_shadows_an_installed_package():
    """A bench script's folder is first on sys.path when it runs, and pytest puts tests/ there:
    a module named like an installed distribution's (bench/kernels.py against Hugging Face's
    `kernels`, which transformers imports) would be imported in its place."""
    installed = importlib.metadata.packages_distributions()
    for folder in ("bench", "docs", "tests"):
        for module in (ROOT / folder).glob("*.py"):
            assert module.stem not in installed, f"{folder}/{module.name} shadows {installed[module.stem]}"


def test_no_test_or_bench_script_edits_sys_path():
    """pytest's `pythonpath` gives the repository root; anything more is path surgery that
    lets a folder's modules shadow installed ones."""
    for folder in ("bench", "docs", "tests"):
        for module in (ROOT / folder).glob("*.py"):
            assert not re.search(r"sys\.path\.(insert|append)\(", module.read_text()), f"{folder}/{module.name}"


def test_results_cite_only_scripts_the_repository_holds():
    """bench/RESULTS.md names the script behind each figure: it is in the repository, or the
    citation says plainly that it was not kept (a session's throwaway script in /tmp)."""
    text = (ROOT / "bench" / "RESULTS.md").read_text()
    for match in re.finditer(r"[\w./-]+\.py\b", text):
        if (ROOT / match.group()).is_file():
            continue
        after = text[match.end():match.end() + 80]
        assert re.match(r"[^()]*?`? \(script not kept\)", after), f"bench/RESULTS.md cites {match.group()}, which is not here"
