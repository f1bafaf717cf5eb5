"""The Ray Data adapter where the README names it: `from colibri.ray_batch import ColibriGenerator`
(it lives in `colibri.cli.ray_batch`, beside the folder job it shares its writing with)."""

from colibri.cli.ray_batch import ColibriGenerator

__all__ = ["ColibriGenerator"]
