"""The notebooks run top to bottom (executed as a user would, in a fresh kernel)."""

from __future__ import annotations

import os

import nbformat
from nbclient import NotebookClient

NOTEBOOKS = os.path.join(os.path.dirname(__file__), "..", "notebooks")


def test_quickstart_notebook(default_model_dir):
    nb = nbformat.read(os.path.join(NOTEBOOKS, "quickstart.ipynb"), as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": NOTEBOOKS}}).execute()
    answer = next(c for c in nb.cells if c.cell_type == "code" and "answer" in c.source)
    text = "".join(o.get("text", "") for o in answer.outputs)
    assert "Paris" in text, text
