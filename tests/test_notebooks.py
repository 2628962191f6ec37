"""The notebooks run top to bottom (executed as a user would, in a fresh kernel)."""

from __future__ import annotations

import os
import re

import nbformat
from nbclient import NotebookClient

NOTEBOOKS = os.path.join(os.path.dirname(__file__), "..", "notebooks")


def test_quickstart_notebook(default_model_dir, optimized_children):
    nb = nbformat.read(os.path.join(NOTEBOOKS, "quickstart.ipynb"), as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": NOTEBOOKS}}).execute()
    answer = next(c for c in nb.cells if c.cell_type == "code" and "answer" in c.source)
    text = "".join(o.get("text", "") for o in answer.outputs)
    assert "Paris" in text, text


def test_sharding_notebook():
    """8 simulated CPU devices in the notebook's own kernel; asserts inside it (greedy equal to
    one device, a trace written) fail the run."""
    nb = nbformat.read(os.path.join(NOTEBOOKS, "sharding.ipynb"), as_version=4)
    NotebookClient(nb, timeout=120, kernel_name="python3",
                   resources={"metadata": {"path": NOTEBOOKS}}).execute()
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                   for o in c.outputs)
    assert "equal to one device: True" in text, text
    # the KV cache, head-major [N, Hkv, P, D], split by KV head
    assert re.search(r"global \(\d+, \d+, \d+, \d+\) P\(None, 'tensor', None, None\)", text), text
