"""The colibri runtime: streams routed experts from the layout and generates text."""

from runtime.engine import BudgetError, Model, open_model

__all__ = ["BudgetError", "Model", "open_model"]
