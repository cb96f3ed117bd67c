"""The package version and where the package lives, importable from any layer.

``ampkit/__init__.py`` sits at the top of the import layers, so lower modules read these
from here instead of importing the package face.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["PACKAGE_DIR", "__version__"]

__version__ = "0.1.0"

PACKAGE_DIR = Path(__file__).resolve().parent.parent
"""The directory of the ``ampkit`` package (frames from files under it are ampkit's own)."""
