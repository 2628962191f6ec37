"""The persistent compilation cache repairs a truncated entry: the next start recompiles it once
and writes it again, the start after hits it. Each start is its own process (jax keeps compiled
programs in memory)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from jaxllm.engine import compilation_cache

# One start: compiles a small program through the cache; prints the cache events it saw.
_START = textwrap.dedent("""
    import json, sys, warnings
    import jax, jax.numpy as jnp, numpy as np
    from jax import monitoring
    events = []
    monitoring.register_event_listener(lambda name, **kw: events.append(name))
    if sys.argv[2] == "repair":
        from jaxllm.engine import compilation_cache
        compilation_cache.enable(sys.argv[1], min_compile_time_secs=0)
    else:  # jax's cache as is
        jax.config.update("jax_compilation_cache_dir", sys.argv[1])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jax.jit(lambda x: jnp.sin(x) @ x.T + 1)(np.ones((8, 8), np.float32)).block_until_ready()
    print(json.dumps({
        "hit": events.count("/jax/compilation_cache/cache_hits"),
        "read_error": sum("Error reading persistent compilation cache" in str(w.message)
                          for w in caught)}))
""")


def _start(cache_dir, mode: str) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", _START, str(cache_dir), mode], env=env,
                         capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(__file__)))
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _entries(cache_dir) -> list:
    return sorted(p for p in cache_dir.iterdir() if p.name.endswith("-cache"))


def _truncate(entry) -> None:
    """Half the file, dated before the settle time, as a process killed mid-write leaves it."""
    data = entry.read_bytes()
    entry.write_bytes(data[:len(data) // 2])
    os.utime(entry, (1e9, 1e9))


def test_truncated_entry_recompiled_once_then_hit(tmp_path):
    assert _start(tmp_path, "repair") == {"hit": 0, "read_error": 0}
    [entry] = _entries(tmp_path)
    sound = entry.read_bytes()
    assert _start(tmp_path, "repair") == {"hit": 1, "read_error": 0}

    _truncate(entry)
    # jax alone: fails to read it, recompiles, and never writes it again
    for _ in range(2):
        assert _start(tmp_path, "plain") == {"hit": 0, "read_error": 1}
    assert len(entry.read_bytes()) == len(sound) // 2

    assert _start(tmp_path, "repair") == {"hit": 0, "read_error": 0}  # removed, recompiled
    # written whole again (a recompiled executable need not serialise to the same bytes)
    assert len(entry.read_bytes()) > len(sound) * 0.9
    assert _start(tmp_path, "repair") == {"hit": 1, "read_error": 0}


def test_checks_only_new_or_changed_entries_and_spares_young_ones(tmp_path, monkeypatch):
    good, bad, young = (tmp_path / f"{n}-cache" for n in ("good", "bad", "young"))
    import zlib
    good.write_bytes(zlib.compress(b"\0\0\0\1executable"))
    bad.write_bytes(zlib.compress(b"\0\0\0\1executable")[:-4])
    (tmp_path / "bad-atime").write_bytes(b"\0" * 8)
    young.write_bytes(b"garbage")
    for entry in (good, bad):
        os.utime(entry, (1e9, 1e9))
    monkeypatch.setattr(compilation_cache.jax_cache, "decompress_executable", zlib.decompress)
    assert compilation_cache.remove_damaged_entries(str(tmp_path)) == ["bad-cache"]
    assert not bad.exists() and not (tmp_path / "bad-atime").exists()
    assert good.exists() and young.exists()  # young: perhaps still being written

    calls = []
    monkeypatch.setattr(compilation_cache, "_readable", lambda f: calls.append(f) or True)
    assert compilation_cache.remove_damaged_entries(str(tmp_path)) == []
    assert calls == []  # good was checked before and is unchanged


@pytest.mark.parametrize("path", [None, ""])
def test_no_path_leaves_the_cache_off(path, monkeypatch):
    updates = []
    monkeypatch.setattr(compilation_cache.jax.config, "update", lambda *a: updates.append(a))
    compilation_cache.enable(path)
    assert updates == []
