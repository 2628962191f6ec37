"""Quantised models with tensor parallelism: FP8 (quantised at load, with and without an FP8 KV
cache, an fp8 checkpoint, a block-wise one at TP=2 (block-scaled per device), and a block-wise
MoE one at TP=2 and EP=2), GPTQ (act order) and AWQ checkpoints give at TP=2 and TP=4 the greedy tokens and
logprobs of the same quantised model on one device; the int4 K-split layout against the
unsplit one; the refusals.

The multi-device runs need XLA_FLAGS before jax starts, so they run in one child process (this
file run as a script, on 4 simulated CPU devices) with PYTHONPATH at this checkout, so that it
imports this checkout's jaxllm whatever is installed. fp32 models, 3 short prompts, one token
bucket, no warm-up: each config compiles its step once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import cpu_devices_env, write_fp8_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUM_DEVICES = 4
MAX_TOKENS = 6
# Largest logprob difference allowed between TP=N and TP=1. Both run the same quantised
# weights in fp32; TP changes only the order of the fp32 partial sums (the all-reduce), ~1e-6
# relative. FP8 activations are rounded to e4m3 from those sums at every layer, so an element
# lying on a rounding boundary may round the other way (one e4m3 step, 1/16 of that element):
# the bound leaves room for such a flip in a tiny model, and is still far below the gap between
# the top tokens that greedy relies on.
LOGPROB_ATOL = 1e-3
RUNS = {  # model -> [(name, engine kwargs)]; the first of each is the one-device reference
    "fp8": [("tp1", {}), ("tp2", dict(tensor_parallel_size=2)),
            ("tp4", dict(tensor_parallel_size=4))],
    "fp8_kv": [("tp1", {}), ("tp2", dict(tensor_parallel_size=2))],
    "fp8_checkpoint": [("tp1", {}), ("tp2", dict(tensor_parallel_size=2)),
                       ("tp4", dict(tensor_parallel_size=4))],  # KV heads repeated up to 4
    "gptq": [("tp1", {}), ("tp2", dict(tensor_parallel_size=2)),
             ("tp4", dict(tensor_parallel_size=4))],
    "awq": [("tp1", {}), ("tp2", dict(tensor_parallel_size=2)),
            ("tp4", dict(tensor_parallel_size=4))],
    "fp8_block_checkpoint": [("tp1", {}), ("tp2", dict(tensor_parallel_size=2))],
    "fp8_static_checkpoint": [("tp1", {}), ("tp2", dict(tensor_parallel_size=2))],
    "fp8_moe_checkpoint": [("tp1", {}), ("tp2", dict(tensor_parallel_size=2)),
                           ("ep2", dict(tensor_parallel_size=2, enable_expert_parallel=True))],
}
ENGINE = dict(dtype="float32", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16,
              num_gpu_blocks_override=48, block_size=8, enforce_eager=True,
              compilation_cache_dir=None)


# -- checkpoints ----------------------------------------------------------------------------
def write_awq(gptq_dir: str, out_dir: str) -> str:
    """The same 4-bit weights as a GPTQ checkpoint (no act order) in AutoAWQ's GEMM layout."""
    from safetensors.numpy import save_file
    from test_quant import awq_pack

    from jaxllm.loader.quant_checkpoint import unpack_gptq
    from jaxllm.loader.safetensors_io import iter_tensors, safetensors_files

    with open(os.path.join(gptq_dir, "config.json")) as f:
        config = json.load(f)
    qconfig = config["quantization_config"]
    assert not qconfig["desc_act"]
    tensors, linears = {}, {}
    for path in safetensors_files(gptq_dir):
        for name, host in iter_tensors(path):
            base, _, suffix = name.rpartition(".")
            if suffix in ("qweight", "qzeros", "scales", "g_idx"):
                linears.setdefault(base, {})[suffix] = np.asarray(host)
            else:
                tensors[name] = np.asarray(host)
    for base, parts in linears.items():
        q, zeros, scales, _ = unpack_gptq(parts, qconfig)
        tensors.update({f"{base}.qweight": awq_pack(q), f"{base}.qzeros": awq_pack(zeros),
                        f"{base}.scales": scales})
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"))
    config["quantization_config"] = {"quant_method": "awq", "w_bit": 4,
                                     "q_group_size": qconfig["group_size"], "zero_point": True,
                                     "version": "gemm"}
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f)
    return out_dir


def write_fp8(model_dir: str, out_dir: str, block: list[int] | None = None) -> str:
    """The checkpoint in vLLM's fp8 format: float8_e4m3fn weights and a per-output-channel
    weight_scale, or block-wise scales (weight_block_size, weight_scale_inv)."""
    qconfig = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    return write_fp8_checkpoint(model_dir, out_dir,
                                qconfig if block is None else {**qconfig,
                                                               "weight_block_size": block})


# -- the child: every run on 4 devices ------------------------------------------------------
KINDS = {}  # (model dir, run) -> the class (and partition) of layer 0's o projection


def _generate(model_dir: str, runs, max_token_id: int = 300, **common) -> dict:
    from jaxllm import LLM, SamplingParams

    prompts = [np.random.default_rng(i).integers(3, max_token_id, size=n).tolist()
               for i, n in enumerate([5, 19, 2])]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    results = {}
    for name, kwargs in runs:
        llm = LLM(model_dir, **ENGINE, **common, **kwargs)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        results[name] = [[(t, entry[t].logprob) for t, entry in
                          zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outs]
        wo = llm.llm_engine.runner.params["layers"][0]["wo"]
        KINDS[model_dir, name] = f"{type(wo).__name__}{list(getattr(wo, 'partition', ()))}"
    return results


def _step_collectives(model_dir: str, **kwargs) -> dict[str, int]:
    """The collectives of a TP=2 step (plain sampler stages), by kind."""
    import re

    from jaxllm import LLM
    from jaxllm.worker.packing import pack

    llm = LLM(model_dir, **ENGINE, tensor_parallel_size=2, **kwargs)
    runner = llm.llm_engine.runner
    packed, layout = pack(runner._padding_inputs(16))
    text = runner._lower(packed, layout, "plain").compile().as_text()
    collective = re.compile(r"= .+? (all-reduce|all-gather|all-to-all|collective-permute|"
                            r"reduce-scatter)(-start)?\(")
    kinds = [m.group(1) for m in map(collective.search, text.splitlines()) if m]
    return {k: kinds.count(k) for k in sorted(set(kinds))}


def _child_main(llama_dir: str, fp8_dir: str, gptq_dir: str, awq_dir: str, fp8_block_dir: str,
                fp8_moe_dir: str, fp8_static_dir: str) -> None:
    import jax

    from jaxllm.models import quant

    assert len(jax.devices()) == NUM_DEVICES, jax.devices()
    # A mesh's FP8 products are W8A8 at any size (the W8A16 GEMV runs on one device only), so
    # the one-device reference takes W8A8 too: the comparison is then of the partitioning alone
    quant.GEMV_MAX_TOKENS = 0
    results = {
        "fp8": _generate(llama_dir, RUNS["fp8"], quantization="fp8"),
        "fp8_kv": _generate(llama_dir, RUNS["fp8_kv"], quantization="fp8", kv_cache_dtype="fp8"),
        "fp8_checkpoint": _generate(fp8_dir, RUNS["fp8_checkpoint"]),
        "gptq": _generate(gptq_dir, RUNS["gptq"]),
        "awq": _generate(awq_dir, RUNS["awq"]),
        "fp8_block_checkpoint": _generate(fp8_block_dir, RUNS["fp8_block_checkpoint"]),
        "fp8_moe_checkpoint": _generate(fp8_moe_dir, RUNS["fp8_moe_checkpoint"],
                                        max_token_id=90),
        "fp8_static_checkpoint": _generate(fp8_static_dir, RUNS["fp8_static_checkpoint"]),
    }
    collectives = {"plain": _step_collectives(llama_dir),
                   "fp8": _step_collectives(llama_dir, quantization="fp8"),
                   "fp8_static": _step_collectives(fp8_static_dir),
                   "awq": _step_collectives(awq_dir), "gptq": _step_collectives(gptq_dir)}
    block_kinds = [KINDS[fp8_block_dir, name] for name, _ in RUNS["fp8_block_checkpoint"]]
    print(json.dumps({"results": results, "collectives": collectives,
                      "block_kinds": block_kinds}))


def test_quantized_tp_equals_one_device(tiny_llama_dir, tiny_qwen3_dir, tmp_path):
    from jaxllm.loader.gptq_writer import write_rtn_gptq

    # Qwen3: o_proj and down_proj read 128 rows, so TP=4 leaves each device one group of 32
    gptq = write_rtn_gptq(tiny_qwen3_dir, str(tmp_path / "gptq"), group_size=32, sym=False,
                          desc_act=True)
    awq = write_awq(write_rtn_gptq(tiny_qwen3_dir, str(tmp_path / "gptq_in_order"),
                                   group_size=32, sym=False), str(tmp_path / "awq"))
    env = dict(cpu_devices_env(NUM_DEVICES), PYTHONPATH=ROOT)
    fp8 = write_fp8(tiny_llama_dir, str(tmp_path / "fp8"))
    # 32-row groups: TP=2 leaves whole groups of o's and down's K on each device
    fp8_block = write_fp8(tiny_llama_dir, str(tmp_path / "fp8_block"), block=[16, 32])
    from test_moe import save_tiny_moe
    # block-wise with 16-row groups: requantised per channel (the dense MLP's K of 40 would
    # not split into whole 32-row groups at TP=2)
    fp8_moe = write_fp8(save_tiny_moe("qwen3_moe", str(tmp_path / "moe"), seed=2),
                        str(tmp_path / "fp8_moe"), block=[16, 16])
    from jaxllm.loader.fp8_writer import calibrated_input_scales
    fp8_static = write_fp8_checkpoint(tiny_llama_dir, str(tmp_path / "fp8_static"),
                                      {"quant_method": "fp8", "activation_scheme": "static"},
                                      calibrated_input_scales(tiny_llama_dir, [list(range(3, 40))]))
    proc = subprocess.run([sys.executable, __file__, tiny_llama_dir, fp8, gptq, awq, fp8_block,
                           fp8_moe, fp8_static],
                          env=env,
                          capture_output=True, text=True, timeout=400, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for model, runs in out["results"].items():
        assert list(runs) == [name for name, _ in RUNS[model]]
        reference = runs["tp1"]
        assert all(len(seq) == MAX_TOKENS for seq in reference)
        for name, outputs in runs.items():
            for got, want in zip(outputs, reference):
                assert [t for t, _ in got] == [t for t, _ in want], f"{model} {name}"
                np.testing.assert_allclose([lp for _, lp in got], [lp for _, lp in want],
                                           rtol=0, atol=LOGPROB_ATOL, err_msg=f"{model} {name}")
    # the block-wise checkpoint runs block-scaled on one device and split by rows at TP=2
    assert out["block_kinds"] == ["Fp8BlockWeight[]", "Fp8BlockWeight['tensor', None]"]
    collectives = out["collectives"]
    # Every quantised array is split as its plain weight, so no weight is gathered: the only
    # all-gather is the logits' (vocab-parallel LM head), as in the plain model; act order (GPTQ
    # desc_act) adds one of the activations before each row-parallel product (2 a layer).
    plain = collectives["plain"]
    assert plain == {"all-reduce": 5, "all-gather": 1}
    assert collectives["awq"] == plain
    assert collectives["gptq"] == {"all-reduce": 5, "all-gather": 1 + 2 * 2}
    # FP8: the per-token scale's max over a split K is one more (small) all-reduce before each
    # row-parallel product.
    assert collectives["fp8"] == {"all-reduce": 5 + 2 * 2, "all-gather": 1}
    # static activation scales need no max: the plain model's collectives
    assert collectives["fp8_static"] == plain


# -- the int4 layout of a K split, and refusals (one device) ----------------------------------
@pytest.mark.parametrize("act_order", [False, True])
def test_int4_k_slices_stand_for_the_same_matrix(act_order):
    from test_quant import random_quantized

    from jaxllm.loader.quant_checkpoint import int4_weight
    from jaxllm.models.quant import dequantize

    k, n, group = 192, 16, 32  # 96 rows a slice: each padded to 128 on its own
    q, zeros, scales, g_idx, dense = random_quantized(5, k, n, group, False, act_order)
    one = int4_weight(q, zeros, scales, g_idx, jnp.float32)
    two = int4_weight(q, zeros, scales, g_idx, jnp.float32, k_shards=2)
    assert one.qweight.shape == (256 // 8, n) and two.qweight.shape == (2 * 128 // 8, n)
    np.testing.assert_allclose(np.asarray(dequantize(two)), dense, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(dequantize(two)), np.asarray(dequantize(one)))
    with pytest.raises(ValueError, match="K=192 in 4 slices of whole groups of 32 rows: 48"):
        int4_weight(q, zeros, scales, g_idx, jnp.float32, k_shards=4)


VLLM_MESSAGE = (r"The input size is not aligned with the quantized weight shape. This can be "
                r"caused by too large tensor parallel size. ")


@pytest.mark.parametrize("method,tp,group,extra,match", [
    ("gptq", 4, 32, {}, VLLM_MESSAGE + r"\(gptq: o_proj's input size 64 split over "
     r"tensor_parallel_size=4 gives 16 rows per device, not a multiple of group_size 32.\)"),
    ("gptq", 2, 128, {}, r"o_proj's input size 64 split over tensor_parallel_size=2 gives 32 "
     r"rows per device, not a multiple of group_size 128"),
    ("awq", 2, 32, dict(intermediate_size=96), r"awq: down_proj's input size 96 split over "
     r"tensor_parallel_size=2 gives 48 rows per device, not a multiple of group_size 32"),
])
def test_int4_row_split_off_group_boundaries_refused(method, tp, group, extra, match, tmp_path):
    from test_quant import config_with

    from jaxllm.engine.args import EngineArgs

    qconfig = {"gptq": {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": True},
               "awq": {"quant_method": "awq", "w_bit": 4, "q_group_size": group,
                       "version": "gemm", "zero_point": True}}[method]
    model = config_with(tmp_path, qconfig, **extra)  # no weights: refused before any load
    with pytest.raises(ValueError, match=match):
        EngineArgs(model=model, tensor_parallel_size=tp).create_engine_config()


def test_tp2_quantized_linears_lower_for_cuda(monkeypatch):
    """The TP=2 products as one layer runs them, lowered for CUDA on 2 abstract H200s (the
    engine's step binds them the same way): int4 row-parallel (act order too) and
    column-parallel run the Pallas kernel per device, the row split summed by an all-reduce;
    FP8's dot keeps float8 operands on the global arrays (GSPMD splits it when compiling)."""
    import jax
    from conftest import h200_mesh, lower_for_h200
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxllm.models.quant import Fp8Weight, Int4Weight, linear

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # the kernel, not its reference
    mesh = h200_mesh(tensor=2)
    sds = lambda shape, dtype, *spec: jax.ShapeDtypeStruct(
        shape, dtype, sharding=NamedSharding(mesh, P(*spec)))
    bf16, t, k, n, group = jnp.bfloat16, 16, 4096, 1024, 128

    def int4(split, perm):
        spec = ("tensor", None) if split == "rows" else (None, "tensor")
        return Int4Weight(sds((k // 8, n), jnp.int32, *spec), sds((k // group, n), bf16, *spec),
                          sds((k // group, n), jnp.uint8, *spec),
                          sds((k,), jnp.int32, spec[0]) if perm else None, k,
                          2 if split == "rows" else 1, spec)

    x_rows, x_whole = sds((t, k), bf16, None, "tensor"), sds((t, k), bf16)
    for x, w in ((x_rows, int4("rows", False)), (x_rows, int4("rows", True)),
                 (x_whole, int4("columns", True))):
        text = lower_for_h200(linear, x, w, mesh=mesh)
        assert "int4_matmul" in text and "__gpu$xla.gpu.triton" in text
        assert ("stablehlo.all_reduce" in text) == (w.partition[0] is not None)
        assert ("stablehlo.all_gather" in text) == (w.perm is not None and w.k_shards > 1)
    fp8 = Fp8Weight(sds((n, k), jnp.float8_e4m3fn, None, "tensor"), sds((n,), jnp.float32))
    text = lower_for_h200(linear, x_rows, fp8, mesh=mesh)
    dot = next(line for line in text.splitlines() if "stablehlo.dot_general" in line)
    assert "(tensor<16x4096xf8E4M3FN>, tensor<1024x4096xf8E4M3FN>) -> tensor<16x1024xbf16>" in dot


if __name__ == "__main__":
    _child_main(*sys.argv[1:])
