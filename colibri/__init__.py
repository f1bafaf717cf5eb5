"""colibri: run Mixture-of-Experts models larger than RAM by streaming experts from disk.

    from colibri import open_model
    model = open_model("~/colibri/qwen3-30b", ram_budget="24G")

The parts: `colibri.formats` (the on-disk layout), `colibri.convert` (checkpoints and GGUFs to
it), `colibri.runtime` (the engine), `colibri.verify` (checks); `colibri.cli` is the command line.
The runtime is imported lazily, so `import colibri.formats` does not compile any kernel. This
folder's own modules are those every layer may import (`version`, `kernel_cache`) and the
documented re-exports (`open_model` and its `EngineOptions` here, `colibri.ray_batch`).
"""

from colibri.version import __version__

__all__ = ["BudgetError", "EngineOptions", "Model", "__version__", "open_model"]


def __getattr__(name):
    if name in ("BudgetError", "EngineOptions", "Model", "open_model"):
        from colibri import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module 'colibri' has no attribute {name!r}")
