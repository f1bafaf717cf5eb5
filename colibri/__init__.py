"""colibri: run Mixture-of-Experts models larger than RAM by streaming experts from disk.

    from colibri import open_model
    model = open_model("~/colibri/qwen3-30b", ram_budget="24G")

The parts: `colibri.formats` (the on-disk layout), `colibri.convert` (checkpoints and GGUFs to
it), `colibri.runtime` (the engine), `colibri.verify` (checks); `colibri.cli` is the command line.
The runtime is imported lazily, so `import colibri.formats` does not compile any kernel.
"""

from colibri.version import __version__

__all__ = ["BudgetError", "Model", "__version__", "open_model"]


def __getattr__(name):
    if name in ("BudgetError", "Model", "open_model"):
        from colibri import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module 'colibri' has no attribute {name!r}")
