"""The layers' small arrays stacked across layers (jaxllm/models/layer_stacks.py): what is stacked
and what is not, the buffers it saves, a step's logits unchanged (bf16, FP8, int4; the CPU's
references and the GPU's kernels in interpret mode), the kernels reading the stacks in place
(no slice of a stack in a one-token FP8 step), and single-device engines built with them."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.loader.dummy import dummy_params
from jaxllm.models import quant, transformer
from jaxllm.models.args import ModelArgs
from jaxllm.models.batch import StepBatch
from jaxllm.models.fused import fuse_params
from jaxllm.models.layer_stacks import Row, layer_views, stack_layers, value
from jaxllm.worker.kv_cache import cache_shape
from pallas_kernels import fp8_gemv, fp8_quant, int4_gemv, quant_matmul

ARGS = ModelArgs(architecture="LlamaForCausalLM", vocab_size=256, hidden_size=128,
                 intermediate_size=256, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=32,
                 rms_norm_eps=1e-5, max_position_embeddings=128)


def int4_of(w: jax.Array, rng) -> quant.Int4Weight:
    """A random int4 weight of w's logical [K, *out] shape (group 64, act order)."""
    k, out = w.shape[0], w.shape[1:]
    n = int(np.prod(out))
    q = rng.integers(0, 16, (k, n))
    packed = jnp.asarray(quant_matmul.pack_int4(q))
    scales = jnp.asarray(rng.uniform(0.002, 0.02, (k // 64, n)), w.dtype)
    zeros = jnp.asarray(rng.integers(0, 16, (k // 64, n)), jnp.uint8)
    shaped = lambda a: a.reshape(a.shape[0], *out)
    return quant.Int4Weight(shaped(packed), shaped(scales), shaped(zeros),
                            jnp.asarray(rng.permutation(k), jnp.int32), k)


def make_params(kind: str, seed: int = 0, args: ModelArgs = ARGS) -> dict:
    """A tiny Llama in the compute layout, norm weights and KV scales random (never all ones),
    its projections bf16, FP8 or int4."""
    rng = np.random.default_rng(seed)
    params = dummy_params(args, jnp.bfloat16, seed=seed)
    for layer in params["layers"]:
        for name, value in layer.items():
            if name.endswith(("norm", "scale")):
                layer[name] = jnp.asarray(rng.uniform(0.2, 3.0, value.shape), value.dtype)
    params = fuse_params(params, args.num_kv_heads)
    if kind == "fp8":
        params = quant.quantize_params_fp8(params)
    elif kind == "int4":
        params["layers"] = [{name: int4_of(w, rng) if name in quant.QUANTIZED_NAMES else w
                             for name, w in layer.items()} for layer in params["layers"]]
    return params


def copy_params(params: dict) -> dict:
    return jax.tree.map(jnp.copy, params)


def step(num_tokens: int, seed: int = 1):
    """A cache (random, not zeros) and a step of num_tokens tokens of one sequence."""
    rng = np.random.default_rng(seed)
    cache = [tuple(jnp.asarray(rng.standard_normal(cache_shape(4, 8, 2, 32)), jnp.bfloat16)
                   for _ in range(2)) for _ in range(ARGS.num_layers)]
    i32 = lambda v: jnp.asarray(v, jnp.int32)
    batch = StepBatch(token_ids=i32(rng.integers(0, 256, num_tokens)),
                      positions=i32(np.arange(num_tokens) + 5), slot_mapping=i32(np.arange(
                          num_tokens) + 13), block_tables=i32([[1, 2, 3]]),
                      cu_q_lens=i32([0, num_tokens]), kv_lens=i32([num_tokens + 5]),
                      num_seqs=i32([1]), logits_indices=i32([num_tokens - 1]))
    return cache, batch


def test_what_is_stacked():
    params = stack_layers(make_params("fp8"))
    assert sorted(params["layer_stacks"]) == ["attn_norm", "mlp_norm", "w_down.scale",
                                              "w_gate_up.scale", "wo.scale", "wqkv.scale"]
    assert params["layer_stacks"]["w_gate_up.scale"].shape == (3, 2, ARGS.intermediate_size)
    for layer in params["layers"]:
        assert "attn_norm" not in layer and layer["wqkv"].scale is None
        assert layer["wqkv"].values.dtype == quant.FP8  # the matrices stay a layer each
    int4 = stack_layers(make_params("int4"))
    assert {"wqkv.scales", "wqkv.zeros", "wqkv.perm"} <= set(int4["layer_stacks"])
    assert not any(key.endswith("qweight") for key in int4["layer_stacks"])


def test_stacking_leaves_few_buffers():
    """Per layer only the four matrices remain: FP8 10 buffers a layer -> 4 (+ 6 stacks),
    int4 (scales, zeros, perm) 18 -> 4 (+ 14)."""
    for kind, before_per_layer, stacks in (("fp8", 10, 6), ("int4", 18, 14), ("bf16", 6, 2)):
        params = make_params(kind)
        before = len(jax.tree.leaves(params))
        after = len(jax.tree.leaves(stack_layers(params)))
        fixed = before - before_per_layer * ARGS.num_layers  # embedding, final norm, LM head
        assert after == fixed + 4 * ARGS.num_layers + stacks, kind


def test_entries_that_differ_across_layers_stay_per_layer():
    """A norm of another size in one layer (or a model of one layer) stacks nothing of it."""
    params = make_params("fp8")
    params["layers"][1]["mlp_norm"] = jnp.ones(64, jnp.bfloat16)
    stacked = stack_layers(params)
    assert "mlp_norm" not in stacked["layer_stacks"] and "attn_norm" in stacked["layer_stacks"]
    assert all("mlp_norm" in layer for layer in stacked["layers"])
    one = make_params("fp8")
    one["layers"] = one["layers"][:1]
    assert stack_layers(one)["layer_stacks"] == {}


def test_views_give_each_layer_its_rows():
    params = make_params("fp8")
    want = [layer["attn_norm"] for layer in params["layers"]]
    scales = [layer["wo"].scale for layer in params["layers"]]
    views = layer_views(stack_layers(copy_params(params)))
    for index, view in enumerate(views):
        assert isinstance(view["attn_norm"], Row) and view["attn_norm"].index == index
        np.testing.assert_array_equal(value(view["attn_norm"]), want[index])
        np.testing.assert_array_equal(value(view["wo"].scale), scales[index])
    assert layer_views(params) is params["layers"]  # unstacked: as they are


@pytest.mark.parametrize("kind", ["bf16", "fp8", "int4"])
@pytest.mark.parametrize("num_tokens", [1, 5])
def test_stacked_step_gives_the_same_logits(kind, num_tokens):
    """The references (the CPU's path): stacked or not, the same logits and caches, bit for
    bit (one token: the GEMV paths; five: W8A8 and the int4 matmul)."""
    params = make_params(kind)
    cache, batch = step(num_tokens)
    want, want_cache = transformer.forward(params, cache, batch, args=ARGS)
    got, got_cache = transformer.forward(stack_layers(copy_params(params)), cache, batch,
                                         args=ARGS)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    for a, b in zip(jax.tree.leaves(got_cache), jax.tree.leaves(want_cache)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_biases_qk_norms_and_kv_scales_stack_too():
    """Qwen-style q/k/v and o biases, q/k norms and a checkpoint's static KV scales (an FP8
    cache): stacked, and the step's logits and float8 pages as before, bit for bit."""
    args = dataclasses.replace(ARGS, qkv_bias=True, o_bias=True, qk_norm=True,
                               kv_cache_scales=True)
    params = make_params("fp8", args=args)
    stacked = stack_layers(copy_params(params))
    assert {"bqkv", "bo", "q_norm", "k_norm", "k_scale", "v_scale"} <= set(stacked["layer_stacks"])
    cache, batch = step(5)
    cache = [tuple(c.astype(quant.FP8) for c in pair) for pair in cache]
    want, want_cache = transformer.forward(params, cache, batch, args=args)
    got, got_cache = transformer.forward(stacked, cache, batch, args=args)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    for a, b in zip(jax.tree.leaves(got_cache), jax.tree.leaves(want_cache)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("kind,num_tokens", [("fp8", 1), ("fp8", 5), ("int4", 1)])
def test_kernels_read_the_stacks_in_place(kind, num_tokens, monkeypatch):
    """The GPU's path (the kernels in interpret mode): the stacked step's logits equal the
    unstacked step's, the kernels reading each layer's row of the stacks (five FP8 tokens: the
    activations' quantisation kernel with the norm inside; int4's tensor-core kernel reads its
    stacks in test_int4_kernels_read_their_rows_of_stacked_scales_and_zeros)."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(fp8_gemv, "fp8_gemv", functools.partial(fp8_gemv.fp8_gemv,
                                                                 interpret=True))
    monkeypatch.setattr(int4_gemv, "int4_gemv", functools.partial(int4_gemv.int4_gemv,
                                                                  interpret=True))
    monkeypatch.setattr(quant_matmul, "int4_matmul",
                        functools.partial(quant_matmul.int4_matmul, interpret=True))
    monkeypatch.setattr(fp8_quant, "fp8_quant", functools.partial(fp8_quant.fp8_quant,
                                                                  interpret=True))
    monkeypatch.setattr(fp8_quant, "fp8_quant_residual",
                        functools.partial(fp8_quant.fp8_quant_residual, interpret=True))
    params = make_params(kind)
    cache, batch = step(num_tokens)
    want, _ = transformer.forward(params, cache, batch, args=ARGS)
    got, _ = transformer.forward(stack_layers(copy_params(params)), cache, batch, args=ARGS)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("stacked", [False, True])
def test_fp8_residual_adds_run_in_the_next_norms_kernel(stacked, monkeypatch):
    """The GPU's path at five FP8 tokens (the kernels in interpret mode): every o and down
    projection's output but the last reaches the stream through the next input norm's
    quantisation kernel (2L - 1 calls, each reading its scale's and its norm's layer: the down
    projection's scale is one layer's, the next attention norm the next layer's), and the step
    gives the CPU path's logits within the kernels' roundings."""
    calls = []
    real = fp8_quant.fp8_quant_residual

    def recorded(*args, scale_layer=None, norm_layer=None, **kw):
        calls.append((scale_layer, norm_layer))
        return real(*args, scale_layer=scale_layer, norm_layer=norm_layer, interpret=True, **kw)
    monkeypatch.setattr(fp8_quant, "fp8_quant_residual", recorded)
    monkeypatch.setattr(fp8_quant, "fp8_quant", functools.partial(fp8_quant.fp8_quant,
                                                                  interpret=True))
    params = make_params("fp8")
    cache, batch = step(5)
    want, want_cache = transformer.forward(params, cache, batch, args=ARGS)  # the CPU's path
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    got, got_cache = transformer.forward(stack_layers(copy_params(params)) if stacked
                                         else params, cache, batch, args=ARGS)
    # (o's scale, the MLP's norm), (down's scale, the next attention norm), ...
    assert calls == ([(0, 0), (0, 1), (1, 1), (1, 2), (2, 2)] if stacked else [(None, None)] * 5)
    scale = float(np.abs(np.asarray(want)).max())
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-3 * scale)
    for a, b in zip(jax.tree.leaves(got_cache), jax.tree.leaves(want_cache)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   rtol=0.02, atol=0.02)


def test_a_one_token_fp8_step_slices_no_stack(monkeypatch):
    """On the GPU's path every use of a stack in a one-token FP8 step is a GEMV call (which
    reads its row in place; a stacked scale reshaped to the kernel's [L, N] first, a bitcast):
    no slice of a stack, which XLA would have to copy for the kernel."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    params = stack_layers(make_params("fp8"))
    cache, batch = step(1)
    jaxpr = jax.make_jaxpr(functools.partial(transformer.forward, args=ARGS))(
        params, cache, batch)
    flat, _ = jax.tree_util.tree_flatten_with_path(params)
    stack_vars = {id(var) for var, (path, _) in zip(jaxpr.jaxpr.invars, flat)
                  if "layer_stacks" in jax.tree_util.keystr(path)}
    assert len(stack_vars) == 6
    gemvs = 0
    for eqn in jaxpr.jaxpr.eqns:  # in order: a reshape's output (a bitcast) is a stack too
        if not any(id(v) in stack_vars for v in eqn.invars):
            continue
        if eqn.primitive.name == "reshape":
            stack_vars.add(id(eqn.outvars[0]))
        else:
            assert eqn.params.get("name") == "fp8_gemv", eqn
            gemvs += 1
    assert gemvs == 4 * ARGS.num_layers


def test_operands_of_one_call_from_two_layers_are_refused():
    rows = (Row(jnp.ones((3, 4)), 0), Row(jnp.ones((3, 4)), 2))
    with pytest.raises(ValueError, match="different layers"):
        quant._one_layer(rows[0].index, rows[1].index)


def test_engines_on_one_device_stack_and_generate_as_before(tiny_llama_dir, monkeypatch):
    """A single-device engine's params carry the stacks, and its greedy tokens and logprobs
    equal an engine's built without them (FP8 weights: every stacked kind of entry)."""
    from jaxllm import LLM, SamplingParams
    from jaxllm.engine import model_setup

    kw = dict(max_model_len=64, max_num_seqs=4, enforce_eager=True, quantization="fp8")
    prompts = [{"prompt_token_ids": p} for p in ([5, 9, 33], [77], [140, 2, 8, 200, 31])]
    params = SamplingParams(temperature=0.0, max_tokens=5, logprobs=3)
    stacked = LLM(tiny_llama_dir, **kw)
    assert "w_gate_up.scale" in stacked.llm_engine.runner.params["layer_stacks"]
    got = stacked.generate(prompts, params, use_tqdm=False)
    del stacked
    monkeypatch.setattr(model_setup, "stack_layers", lambda params: params)
    plain = LLM(tiny_llama_dir, **kw)
    assert "layer_stacks" not in plain.llm_engine.runner.params
    want = plain.generate(prompts, params, use_tqdm=False)
    for a, b in zip(got, want):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


# -- the kernels: a stacked operand's row read in place ---------------------------------------
def poisoned_stack(a: jax.Array, layer: int, num_layers: int = 4) -> jax.Array:
    """[L, *a.shape] with a at row `layer`; the other rows NaN (floats) or other values."""
    fill = (jnp.full(a.shape, jnp.nan, a.dtype) if jnp.issubdtype(a.dtype, jnp.floating)
            else (a + 7).astype(a.dtype))
    return jnp.stack([a if i == layer else fill for i in range(num_layers)])


def test_fp8_gemv_reads_its_rows_of_stacked_scales_and_norm():
    from test_fp8_gemv import random_inputs
    for n, k, splits in ((96, 256, 1), (70, 1000, 3)):  # the kernel's RMS, the wrapper's
        x, values, scale = random_inputs(n, 1, n, k)
        norm = jnp.asarray(np.random.default_rng(n).uniform(0.2, 3, k), jnp.bfloat16)
        gemv = functools.partial(fp8_gemv.fp8_gemv, eps=1e-5, block_n=16, block_k=64,
                                 splits=splits, interpret=True)
        want = gemv(x, values, scale, norm)
        got = gemv(x, values, poisoned_stack(scale, 2), poisoned_stack(norm, 2), layer=2)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        mixed = gemv(x, values, scale, poisoned_stack(norm, 1), layer=1)
        np.testing.assert_array_equal(np.asarray(mixed), np.asarray(want))
    with pytest.raises(ValueError, match="layer"):
        gemv(x, values, poisoned_stack(scale, 2))
    with pytest.raises(ValueError, match="layer"):
        gemv(x, values, poisoned_stack(scale, 2), layer=4)


@pytest.mark.parametrize("kernel", ["int4_gemv", "int4_matmul"])
def test_int4_kernels_read_their_rows_of_stacked_scales_and_zeros(kernel):
    from test_int4_gemv import random_inputs
    m = 1 if kernel == "int4_gemv" else 3
    (x, qweight, scales, zeros), _ = random_inputs(5, m, 512, 96, 64, jnp.bfloat16)
    call = functools.partial(getattr(int4_gemv if kernel == "int4_gemv" else quant_matmul,
                                     kernel), splits=2, interpret=True)
    want = call(x, qweight, scales, zeros)
    got = call(x, qweight, poisoned_stack(scales, 3), poisoned_stack(zeros, 3), layer=3)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    with pytest.raises(ValueError, match="layer"):
        call(x, qweight, poisoned_stack(scales, 3), zeros)


def test_silu_mul_fp8_reads_its_row_of_a_stacked_weight_scale():
    from pallas_kernels.silu_mul_fp8 import silu_mul_fp8
    from test_silu_mul_fp8 import random_inputs
    y, x_scale, w_scale = random_inputs(4, 5, 200)
    for tiles in (dict(block_cols=64), dict()):  # two passes; the row in one chunk
        want = silu_mul_fp8(y, x_scale, w_scale, interpret=True, **tiles)
        got = silu_mul_fp8(y, x_scale, poisoned_stack(w_scale, 0), layer=0, interpret=True,
                           **tiles)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_stacked_kernels_lower_for_cuda():
    from conftest import lower_for_h200
    from pallas_kernels.silu_mul_fp8 import silu_mul_fp8
    sds, num_layers = jax.ShapeDtypeStruct, 32
    for n in (28672, 6144):
        text = lower_for_h200(functools.partial(fp8_gemv.fp8_gemv, eps=1e-5, layer=31),
                              sds((1, 4096), jnp.bfloat16), sds((n, 4096), quant.FP8),
                              sds((num_layers, n), jnp.float32),
                              sds((num_layers, 4096), jnp.bfloat16))
        assert "fp8_gemv" in text
    int4 = (sds((1, 4096), jnp.bfloat16), sds((512, 6144), jnp.int32),
            sds((num_layers, 32, 6144), jnp.bfloat16), sds((num_layers, 32, 6144), jnp.uint8))
    assert "int4_gemv" in lower_for_h200(functools.partial(int4_gemv.int4_gemv, layer=5), *int4)
    assert "int4_matmul" in lower_for_h200(functools.partial(quant_matmul.int4_matmul, layer=5),
                                           *int4)
    assert "silu_mul_fp8" in lower_for_h200(
        functools.partial(silu_mul_fp8, layer=7), sds((512, 28672), jnp.bfloat16),
        sds((512,), jnp.float32), sds((num_layers, 28672), jnp.float32))


@pytest.mark.parametrize("kind,num_tokens", [("bf16", 1), ("bf16", 5), ("fp8", 1), ("fp8", 5)])
@pytest.mark.parametrize("stacked", [False, True])
def test_rope_write_gives_the_unfused_step(kind, num_tokens, stacked):
    """The Pallas backends' rope and KV write (one kernel, interpret mode) in a step: the
    logits and caches of the unfused rope and scatter. At five FP8 tokens qkv reaches it as
    the W8A8 GEMM's unscaled product, its channel scales a row of a stack when stacked."""
    from jaxllm.models.attention import RopeKVWrite

    params = make_params(kind)
    if stacked:
        params = stack_layers(params)
    cache, batch = step(num_tokens)
    want, want_cache = transformer.forward(params, cache, batch, args=ARGS)
    got, got_cache = transformer.forward(params, cache, batch, args=ARGS,
                                         write_kv=RopeKVWrite(interpret=True))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-2, atol=1e-2)
    for a, b in zip(jax.tree.leaves(got_cache), jax.tree.leaves(want_cache)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   rtol=2 ** -7, atol=2 ** -7)


@pytest.mark.parametrize("stacked", [False, True])
def test_rope_write_finishes_the_one_token_qkv_gemv(stacked, monkeypatch):
    """The GPU's path at one FP8 token (the kernels in interpret mode, the GEMVs' K split in
    two): each layer's qkv GEMV reaches the rope and KV write unfinished (its partial products
    and its input norm's sums of squares, a quant.SplitProduct), and the step's logits and
    caches are the unfused write's within its roundings."""
    from jaxllm.models.attention import RopeKVWrite
    from pallas_kernels import kv_write

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(fp8_gemv, "fp8_gemv", functools.partial(
        fp8_gemv.fp8_gemv, interpret=True, block_k=32, splits=2))
    finished_inside, real = [], kv_write.rope_write_kv

    def recorded(*args, splits=None, **kw):
        finished_inside.append(splits is not None and splits[0] is not None)
        return real(*args, splits=splits, **kw)
    monkeypatch.setattr(kv_write, "rope_write_kv", recorded)
    params = make_params("fp8")
    if stacked:
        params = stack_layers(params)
    cache, batch = step(1)
    want, want_cache = transformer.forward(params, cache, batch, args=ARGS)
    got, got_cache = transformer.forward(params, cache, batch, args=ARGS,
                                         write_kv=RopeKVWrite(interpret=True))
    assert finished_inside == [True] * ARGS.num_layers
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-2, atol=1e-2)
    for a, b in zip(jax.tree.leaves(got_cache), jax.tree.leaves(want_cache)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   rtol=2 ** -7, atol=2 ** -7)
