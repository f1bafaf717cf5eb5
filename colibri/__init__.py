"""colibri: run Mixture-of-Experts models larger than RAM by streaming experts from disk."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("colibri")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+source"
