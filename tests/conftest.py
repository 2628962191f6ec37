"""Shared fixtures: tiny random HF checkpoints on disk (Llama with llama3 rope scaling, Qwen2 with
qkv bias, Qwen3 with q/k norm; fp32, tokenizer included) and the converted default model."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The tests' models are tiny, so XLA's CPU compiles, not their runs, take most of the suite's
# time; LLVM's optimisation passes are most of a compile (docs/lab, session 52).
CPU_COMPILE_FLAGS = "--xla_backend_optimization_level=0"
if CPU_COMPILE_FLAGS not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {CPU_COMPILE_FLAGS}".strip()

import numpy as np
import pytest


@pytest.fixture
def optimized_children(monkeypatch):
    """Child processes started in the test compile with XLA's full optimisation: where a child
    runs a larger model (a notebook on the default model), its runs, not its compiles, take its
    time."""
    flags = os.environ["XLA_FLAGS"].replace(CPU_COMPILE_FLAGS, "").strip()
    monkeypatch.setenv("XLA_FLAGS", flags)


def cpu_devices_env(num_devices: int) -> dict[str, str]:
    """The environment of a child process with num_devices simulated CPU devices (XLA_FLAGS
    must be set before jax starts), this process's compile flags kept."""
    flags = os.environ.get("XLA_FLAGS", "")
    flags = f"{flags} --xla_force_host_platform_device_count={num_devices}".strip()
    return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags)

CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n'"
    " }}{% endif %}")
TINY_VOCAB = 384
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores keys and values in fixed-size blocks of tokens.",
    "Hello world, how are you today? I am fine, thank you very much!",
    "JAX compiles numerical programs for accelerators; Pallas writes kernels.",
    "0123456789 + - * / = ( ) [ ] { } < > , . ; : ! ? ' \" # $ % & @ ^ _ ` | ~",
] * 4

_BASE = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
             pad_token_id=0)
TINY_CONFIGS = {
    # original_max_position_embeddings is small so llama3 scaling changes these head_dim's freqs
    "llama": dict(_BASE, architectures=["LlamaForCausalLM"], model_type="llama",
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 64}),
    "qwen2": dict(_BASE, architectures=["Qwen2ForCausalLM"], model_type="qwen2",
                  num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "qwen3": dict(_BASE, architectures=["Qwen3ForCausalLM"], model_type="qwen3",
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
}


def build_tiny_tokenizer():
    """A byte-level BPE trained offline on a few sentences, with ChatML special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY_VOCAB - 8, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<|im_start|>",
                                   eos_token="<|im_end|>", chat_template=CHATML_TEMPLATE)


def _randomize(model, seed: int) -> None:
    """Random everything (HF's init leaves norms at 1 and biases at 0, which hides bugs)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.08 * noise)


def save_random_checkpoint(config: dict, out_dir: str, tokenizer=None, seed: int = 0) -> str:
    """An HF checkpoint of `config` (a dict with model_type) with random weights everywhere."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(config)
    hf_config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    _randomize(model, seed)
    model.save_pretrained(out_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    return out_dir


def save_tiny_checkpoint(kind: str, out_dir: str, tokenizer, seed: int = 0) -> str:
    return save_random_checkpoint(TINY_CONFIGS[kind], out_dir, tokenizer, seed)


def write_fp8_checkpoint(model_dir: str, out_dir: str, quantization_config: dict,
                         extra_tensors: dict | None = None) -> str:
    """model_dir with every decoder linear as float8_e4m3fn, scaled per output channel or per
    block as quantization_config says (jaxllm/loader/fp8_writer.py), extra_tensors added."""
    from jaxllm.loader.fp8_writer import write_fp8
    return write_fp8(model_dir, out_dir, quantization_config, extra_tensors)


def write_fp8_kv_scaled(model_dir: str, out_dir: str, kv_scales: dict[int, tuple]) -> str:
    """model_dir as a compressed-tensors checkpoint: float8 linears with per-channel scales,
    and a static per-tensor kv_cache_scheme with kv_scales (layer -> (k, v)) stored as each
    layer's self_attn.k_scale / v_scale, shaped [1] on layer 0 and [] elsewhere (writers
    differ)."""
    scales = {}
    for layer, (k, v) in kv_scales.items():
        shape = (1,) if layer == 0 else ()
        scales[f"model.layers.{layer}.self_attn.k_scale"] = np.full(shape, k, np.float32)
        scales[f"model.layers.{layer}.self_attn.v_scale"] = np.full(shape, v, np.float32)
    float8 = {"type": "float", "num_bits": 8, "symmetric": True}
    return write_fp8_checkpoint(model_dir, out_dir, {
        "quant_method": "compressed-tensors",
        "config_groups": {"group_0": {"targets": ["Linear"],
                                      "weights": dict(float8, strategy="channel")}},
        "kv_cache_scheme": dict(float8, strategy="tensor", dynamic=False)}, scales)


@pytest.fixture(autouse=True, scope="module")
def _free_engines_after_each_module():
    """Engines move their start-up objects out of the garbage collector's reach
    (jaxllm/engine/builder.py: gc.freeze), and jax's jit caches keep every engine's programs,
    so without this each module's engines would live until the run ends."""
    yield
    import gc

    import jax

    gc.unfreeze()
    gc.collect()
    jax.clear_caches()


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, tiny_tokenizer) -> str:
    return save_tiny_checkpoint("llama", str(tmp_path_factory.mktemp("tiny_llama")), tiny_tokenizer, 1)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory, tiny_tokenizer) -> str:
    return save_tiny_checkpoint("qwen2", str(tmp_path_factory.mktemp("tiny_qwen2")), tiny_tokenizer, 2)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory, tiny_tokenizer) -> str:
    return save_tiny_checkpoint("qwen3", str(tmp_path_factory.mktemp("tiny_qwen3")), tiny_tokenizer, 3)


@pytest.fixture(scope="session")
def tiny_model_dirs(tiny_llama_dir, tiny_qwen2_dir, tiny_qwen3_dir) -> dict[str, str]:
    return {"llama": tiny_llama_dir, "qwen2": tiny_qwen2_dir, "qwen3": tiny_qwen3_dir}


@pytest.fixture(scope="session")
def default_model_dir() -> str:
    """The converted SmolLM2-135M-Instruct (fetched and converted once into the cache)."""
    from jaxllm.loader.default_model import default_model_dir as resolve

    return resolve()


def h200_mesh(tensor: int = 0):
    """An abstract mesh of H200s: none (one device), or `tensor` along the "tensor" axis (the
    ShapeDtypeStructs of a sharded program name it in their shardings)."""
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType

    axes = ((tensor,), ("tensor",), (AxisType.Auto,)) if tensor else ((), ())  # as make_mesh's
    return AbstractMesh(*axes, abstract_device=AbstractDevice(
        device_kind="NVIDIA H200", platform="gpu", num_cores=132))


def lower_for_h200(fn, *args, mesh=None, triton_modules: list | None = None):
    """Lowers `fn(*args)` (ShapeDtypeStructs) for CUDA on this CPU machine, under an abstract
    H200 (or `mesh`, from h200_mesh), and runs MLIR's verifier on every Triton module a Pallas
    kernel produces: the GPU's Triton compiler rejects a module that fails it (e.g. an scf.for
    whose bounds differ in type), which lowering alone never checks. triton_modules: a list
    that gets each such module's text."""
    import jax
    from jax._src.pallas.triton import lowering

    lower_module = lowering.lower_jaxpr_to_triton_module

    def lower_and_verify(*a, **kw):
        result = lower_module(*a, **kw)
        result.module.operation.verify()  # raises with the failing op
        if triton_modules is not None:
            triton_modules.append(str(result.module))
        return result

    mesh = h200_mesh() if mesh is None else mesh
    lowering.lower_jaxpr_to_triton_module = lower_and_verify
    try:
        with jax.sharding.use_abstract_mesh(mesh):
            return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    finally:
        lowering.lower_jaxpr_to_triton_module = lower_module


class CompileCounter:
    """A jax.monitoring listener counting backend compilations (no compilation after warm-up)."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, event: str, duration: float, **kwargs) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            self.count += 1
