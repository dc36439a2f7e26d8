"""Where numba keeps compiled kernels, decided before numba is imported.

numba caches kernels next to the source (``index/__pycache__``); when that directory is not
writable (a package installed by root, run as a non-root user) and ``NUMBA_CACHE_DIR`` is unset,
``@njit(cache=True)`` raises at import time. So, before the first import of numba, an unwritable
package directory sends the cache to ``$TMPDIR/kvrouter-numba-<uid>``: compiling then happens once
per machine (~15 s) instead of failing, and later starts load in ~0.3 s.
"""

from __future__ import annotations

import os
import tempfile


def ensure_cache_dir() -> None:
    """Set ``NUMBA_CACHE_DIR`` to a writable place when the package's own is not."""
    if os.environ.get("NUMBA_CACHE_DIR"):
        return
    here = os.path.dirname(os.path.abspath(__file__))
    target = os.path.join(here, "__pycache__")
    probe = target if os.path.isdir(target) else here
    if os.access(probe, os.W_OK):
        return
    uid = os.getuid() if hasattr(os, "getuid") else 0
    os.environ["NUMBA_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), f"kvrouter-numba-{uid}")
