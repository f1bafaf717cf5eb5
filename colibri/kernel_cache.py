"""numba's on-disk cache, kept in step with the code that generates the kernels.

numba drops a cached function when the source file of that function changes, not when an
`@intrinsic` it calls (LLVM IR built in another module) or a table baked into it does: after an
update that touched only the IR builders, the old machine code would keep running. Each
compiled package checks a hash of the sources its kernels are built from against the stamp
its last check left in its cache folders, and deletes their cache files when it differs.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

CACHE_SUFFIXES = (".nbi", ".nbc")


def sources_hash(sources) -> str:
    digest = hashlib.sha256()
    for path in sorted(Path(p) for p in sources):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def drop_if_stale(name: str, sources, caches) -> bool:
    """Delete the numba cache files in the folders `caches` when `sources` changed since the
    last call (a stamp `name.sources.sha256` in the first folder). Whether anything was
    dropped. A custom NUMBA_CACHE_DIR or a folder that cannot be written is left alone."""
    if os.environ.get("NUMBA_CACHE_DIR"):
        return False
    caches = [Path(c) for c in caches]
    stamp = caches[0] / f"{name}.sources.sha256"
    digest = sources_hash(sources)
    try:
        if stamp.is_file() and stamp.read_text().strip() == digest:
            return False
        dropped = False
        for folder in caches:
            for path in folder.glob("*") if folder.is_dir() else ():
                if path.suffix in CACHE_SUFFIXES:
                    path.unlink(missing_ok=True)
                    dropped = True
        caches[0].mkdir(parents=True, exist_ok=True)
        partial = stamp.with_name(stamp.name + f".{os.getpid()}")
        partial.write_text(digest + "\n")
        os.replace(partial, stamp)
        return dropped
    except OSError:  # a read-only install: numba caches elsewhere, or not at all
        return False
