"""The installed version of colibri: a leaf module every layer may read (it imports nothing of ours)."""

from importlib.metadata import PackageNotFoundError, version

DISTRIBUTION = "colibri-moe"

try:
    __version__ = version(DISTRIBUTION)
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+source"
