"""gmtool: make CUDA graph mode for LLM inference visible and measurable."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("gmtool")
except PackageNotFoundError:  # run from the tree (PYTHONPATH=.), not installed
    __version__ = "0.1.0+tree"
