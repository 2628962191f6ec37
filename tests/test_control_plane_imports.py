"""The control plane (requests, blocks, scheduler, detokenizer) is plain Python: importing it must
not import JAX (checked in a fresh interpreter, where nothing else has imported it yet)."""

from __future__ import annotations

import subprocess
import sys


def test_control_plane_imports_no_jax():
    code = ("import sys; import jaxllm.core.scheduler, jaxllm.core.dp_scheduler, "
            "jaxllm.core.kv_cache_manager, "
            "jaxllm.core.block_pool, jaxllm.detok.detokenizer, jaxllm.sampling_params; "
            "print(sorted(m for m in sys.modules if m == 'jax' or m.startswith('jax.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         check=True).stdout.strip()
    assert out == "[]", out
