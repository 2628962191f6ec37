"""The GGUF import on the lowest transformers pyproject.toml allows: that release (with the
tokenizers and huggingface-hub it requires) is pip-installed once into a folder of the cache and
put first on a subprocess's path; the default model's tokenizer is built, saved and loaded back
there and must give the recorded ids and chat template."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import tomllib

from test_default_model import CHAT_REFERENCE, REFERENCE_IDS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The lowest transformers and the releases it needs that the venv's newer ones would break.
FLOOR = ("transformers==4.46.3", "tokenizers==0.20.3", "huggingface-hub==0.26.5")

_CHECK = textwrap.dedent("""
    import json, sys, tempfile
    import transformers
    from gguf import GGUFReader
    from transformers import AutoTokenizer
    from jaxllm.loader.gguf_import import read_metadata, tokenizer_from_metadata
    gguf_path, cases, chat_reference = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    out = tempfile.mkdtemp()
    tokenizer_from_metadata(read_metadata(GGUFReader(gguf_path))).save_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    bad = [text for text, ids in cases if tok(text).input_ids != ids or tok.decode(ids) != text]
    chat = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi ✓"}]
    rendered = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    print(json.dumps({"version": transformers.__version__, "bad": bad,
                      "chat_ok": rendered == chat_reference}))
""")


def _floor_in_pyproject() -> str:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    [spec] = [d for d in deps if re.match(r"transformers\b", d)]
    return re.search(r">=\s*([\w.]+)", spec).group(1)


def _install_floor() -> str:
    """The floor's packages in a folder of the cache, installed on first use."""
    from jaxllm.loader.default_model import cache_root

    target = os.path.join(cache_root(), ".test-transformers-" + "-".join(FLOOR))
    if not os.path.exists(os.path.join(target, ".complete")):
        out = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                              "--target", target, *FLOOR], capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 0, f"pip install {FLOOR} failed: {out.stderr[-2000:]}"
        open(os.path.join(target, ".complete"), "w").close()
    return target


def test_floor_is_the_declared_lower_bound():
    assert FLOOR[0] == f"transformers=={_floor_in_pyproject()}"


def test_gguf_import_on_the_lowest_transformers(default_model_dir):
    from jaxllm.loader.default_model import default_gguf_path

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([_install_floor(), ROOT]),
               JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", _CHECK, default_gguf_path(),
                          json.dumps(REFERENCE_IDS), CHAT_REFERENCE],
                         env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"version": _floor_in_pyproject(), "bad": [], "chat_ok": True}
