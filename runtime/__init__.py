"""The colibri runtime: streams routed experts from the layout and generates text.

    from colibri.runtime import open_model

Imported lazily, so that light modules (`runtime.memory`) do not pull in the kernels.
"""

__all__ = ["BudgetError", "EngineOptions", "Model", "open_model"]


def __getattr__(name):
    if name in __all__:
        from colibri.runtime import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'colibri.runtime' has no attribute {name!r}")
