"""jax's persistent compilation cache, with damaged entries removed before jax reads them.

jax (0.11) keeps one file per program, `<key>-cache`: the compressed (zstd or zlib) compile time
and serialized executable, written in place. A process killed mid-write leaves a truncated file.
jax then fails to read it (a warning), recompiles, and does not write the entry again because
the file exists, so every later start pays the compilation. `enable` checks each entry that is
new since the last start (the first start checks all) and removes those that do not decompress,
so the next compilation writes them again.
"""

from __future__ import annotations

import json
import logging
import os
import time

import jax
from jax._src import compilation_cache as jax_cache

logger = logging.getLogger(__name__)

_ENTRY_SUFFIX = "-cache"  # jax's LRUCache names
_ATIME_SUFFIX = "-atime"
_CHECKED = ".jaxllm-checked.json"  # entries found sound: name -> [size, mtime_ns]
# A younger entry may still be being written by another process starting at the same time.
_SETTLE_SECS = 60.0


def enable(path: str | None, min_compile_time_secs: float = 0.5) -> None:
    """Persistent cache at `path` (None: off) for programs that take longer than
    `min_compile_time_secs` to compile, after removing damaged entries from it."""
    if not path:
        return
    path = os.path.expanduser(path)
    os.makedirs(path, exist_ok=True)
    removed = remove_damaged_entries(path)
    if removed:
        logger.warning("compilation cache %s: removed %d damaged entr%s (%s); they are compiled "
                       "and written again", path, len(removed), "y" if len(removed) == 1 else "ies",
                       ", ".join(removed[:3]) + (" ..." if len(removed) > 3 else ""))
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_time_secs)


def remove_damaged_entries(path: str, settle_secs: float = _SETTLE_SECS) -> list[str]:
    """Removes every entry of the cache at `path` that does not decompress to a compile time
    and an executable; returns their names. Entries checked before and unchanged since are
    skipped; entries younger than `settle_secs` are left for the next start."""
    checked = _load_checked(path)
    sound, removed = {}, []
    now = time.time()
    for name in sorted(os.listdir(path)):
        if not name.endswith(_ENTRY_SUFFIX):
            continue
        file = os.path.join(path, name)
        try:
            stat = os.stat(file)
        except FileNotFoundError:  # evicted by a concurrent process
            continue
        signature = [stat.st_size, stat.st_mtime_ns]
        if checked.get(name) == signature:
            sound[name] = signature
        elif now - stat.st_mtime < settle_secs:
            continue
        elif _readable(file):
            sound[name] = signature
        else:
            _remove_entry(path, name)
            removed.append(name)
    _save_checked(path, sound)
    return removed


def _readable(file: str) -> bool:
    """Whether the entry decompresses, as jax reads it, to more than its compile-time header."""
    try:
        with open(file, "rb") as f:
            data = jax_cache.decompress_executable(f.read())
    except Exception:  # zlib.error, zstd's errors: a truncated or garbled stream
        return False
    return len(data) > jax_cache._TIME_BYTES


def _remove_entry(path: str, name: str) -> None:
    key = name[:-len(_ENTRY_SUFFIX)]
    for file in (name, key + _ATIME_SUFFIX):
        try:
            os.remove(os.path.join(path, file))
        except FileNotFoundError:
            pass


def _load_checked(path: str) -> dict:
    try:
        with open(os.path.join(path, _CHECKED)) as f:
            checked = json.load(f)
        return checked if isinstance(checked, dict) else {}
    except (OSError, ValueError):
        return {}


def _save_checked(path: str, checked: dict) -> None:
    """Written to a temporary file and renamed, so concurrent starts never read half of it."""
    tmp = os.path.join(path, f"{_CHECKED}.{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            json.dump(checked, f)
        os.replace(tmp, os.path.join(path, _CHECKED))
    except OSError as exc:  # a read-only cache still serves hits
        logger.debug("compilation cache %s: not recording checked entries: %s", path, exc)
