"""The W8A16 FP8 GEMV: the Pallas kernel (interpret mode) against the jnp reference, the
reference against numpy (ml_dtypes' float8), the input norm inside it, quant.linear's and
norm_linear's routing (few tokens to the GEMV, more to W8A8, one device only), the CUDA lowering
of the kernel and of linear's GPU path, and gemv_report.py's lowering step."""

import functools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import lower_for_h200

from jaxllm.models import quant
from jaxllm.models.layers import dense_mlp
from jaxllm.models.quant import GEMV_MAX_TOKENS, dequantize, fp8_gemv_applies, linear, quantize_fp8
from jaxllm.worker.kv_cache import cache_shape
from pallas_kernels import fp8_gemv as gemv
from pallas_kernels.fp8_gemv import FP8, fp8_gemv, fp8_gemv_reference

# kernel vs reference: both fp32 sums, in other orders (each off by up to ~K fp32 epsilons of
# the sum of the terms' magnitudes), then one rounding to x's dtype (one unit in the last place)
RTOL = {jnp.bfloat16: 2 ** -7, jnp.float16: 2 ** -9, jnp.float32: 1e-6}
SUM_TOL = 1e-5


def random_inputs(seed, m, n, k, dtype=jnp.bfloat16):
    """x with rows of different magnitudes, float8 values over their whole range (never zero),
    channel scales spanning two decades."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)) * rng.choice([0.1, 1.0, 10.0], (m, 1))
    mags = 2.0 ** rng.uniform(-6, np.log2(448), (n, k))
    values = (mags * rng.choice([-1.0, 1.0], (n, k))).astype(ml_dtypes.float8_e4m3fn)
    scale = 10.0 ** rng.uniform(-4, -2, n)
    return (jnp.asarray(x, jnp.float32).astype(dtype), jnp.asarray(values),
            jnp.asarray(scale, jnp.float32))


def assert_close(got, x, values, scale, x_rounded=False):
    """x_rounded: x itself carries up to two roundings to its dtype that the kernel does not
    make (the reference's norm), each term of the sum off by as much."""
    want = np.asarray(fp8_gemv_reference(x, values, scale), np.float32)
    terms = np.abs(np.asarray(x, np.float32)) @ np.abs(np.asarray(values, np.float32)).T
    term_tol = SUM_TOL + (RTOL[x.dtype.type] if x_rounded else 0)
    bound = RTOL[x.dtype.type] * np.abs(want) + term_tol * terms * np.asarray(scale)
    assert np.all(np.abs(np.asarray(got, np.float32) - want) <= bound)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("m,n,k,tiles", [
    (1, 200, 300, dict(block_n=32, block_k=64)),  # N and K ragged against the tiles
    (3, 70, 1000, dict(block_n=16, block_k=128, splits=3, num_stages=3)),  # pipelined
    (8, 48, 520, dict(block_n=32, block_k=64, splits=4)),  # 9 K tiles: 1 split empty
    (3, 90, 520, dict(block_n=16, block_k=64, splits=7)),  # two empty splits
    (1, 300, 700, dict()),  # the defaults
    (16, 40, 100, dict()),
])
def test_kernel_matches_reference(m, n, k, tiles, dtype):
    x, values, scale = random_inputs(m + n + k, m, n, k, dtype)
    got = fp8_gemv(x, values, scale, interpret=True, **tiles)
    assert got.shape == (m, n) and got.dtype == dtype
    assert_close(got, x, values, scale)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("m,n,k,tiles", [
    (1, 200, 300, dict(block_n=32, block_k=64)),  # K not a power of two: the rows' mask
    (3, 70, 1000, dict(block_n=16, block_k=128, splits=3)),  # splits: the wrapper's RMS
    (2, 90, 520, dict(block_n=16, block_k=64, splits=7)),  # two empty splits
    (1, 96, 512, dict()),
])
def test_norm_inside_matches_norm_then_gemv(m, n, k, tiles, dtype):
    """With norm_weight the kernel is rms_norm then the GEMV: against the reference that runs
    them apart (x far from unit scale and a weight around 1, so a missing or doubled norm is off by
    far more than the tolerance), and not against the GEMV of x as it is."""
    x, values, scale = random_inputs(7 * m + n + k, m, n, k, dtype)
    x = x * 30
    weight = jnp.asarray(np.random.default_rng(k).uniform(0.5, 1.5, k), dtype)
    got = fp8_gemv(x, values, scale, weight, eps=1e-5, interpret=True, **tiles)
    assert got.dtype == dtype
    normed = gemv.rms_norm_reference(x, weight, 1e-5)
    assert_close(got, normed, values, scale, x_rounded=True)
    np.testing.assert_allclose(np.asarray(fp8_gemv_reference(x, values, scale, weight, 1e-5),
                                          np.float32), np.asarray(fp8_gemv_reference(
                                              normed, values, scale), np.float32))
    plain = np.asarray(fp8_gemv_reference(x, values, scale), np.float32)
    assert np.max(np.abs(np.asarray(got, np.float32) - plain)) > 0.5 * np.max(np.abs(plain))


def test_split_sums_are_elementwise_adds():
    """The wrapper sums the K splits' products and (with a norm) their sums of squares as one
    add a split: XLA fuses those into the consumers, where a reduction over the split axis is a
    launch-bound kernel of its own on the GPU (32 a batch-1 step of an 8B FP8 model,
    benchmarks/experiments/deviceless_step.py)."""
    x, values, scale = random_inputs(3, 1, 64, 1024, jnp.bfloat16)
    weight = jnp.ones((1024,), jnp.bfloat16)
    jaxpr = jax.make_jaxpr(functools.partial(fp8_gemv, eps=1e-5, splits=4, interpret=True))(
        x, values, scale, weight)
    outside = [eqn.primitive.name for eqn in jaxpr.jaxpr.eqns[0].params["jaxpr"].eqns]
    assert "pallas_call" in outside and "reduce_sum" not in outside
    assert outside.count("add") >= 2 * 3


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("m,n,k,tiles", [
    (1, 64, 300, dict(block_n=32, block_k=64)),  # K ragged: the up half starts mid-tile
    (2, 70, 1000, dict(block_n=16, block_k=128, splits=3)),
    (1, 96, 512, dict()),
])
def test_swiglu_inside_matches_silu_mul_then_gemv(m, n, k, tiles, dtype):
    """With swiglu the kernel's operand is silu(gate) * up of x [M, 2K]: against the reference
    that takes it apart (its silu and product rounded to x's dtype, the kernel's once), and not
    against the gate half alone."""
    x, values, scale = random_inputs(3 * m + n + k, m, n, 2 * k, dtype)
    values = values[:, :k]
    got = fp8_gemv(x, values, scale, swiglu=True, interpret=True, **tiles)
    assert got.shape == (m, n) and got.dtype == dtype
    hidden = jax.nn.silu(x[:, :k]) * x[:, k:]
    assert_close(got, hidden, values, scale, x_rounded=True)
    np.testing.assert_array_equal(np.asarray(fp8_gemv_reference(x, values, scale, swiglu=True)),
                                  np.asarray(fp8_gemv_reference(hidden, values, scale)))
    gate = np.asarray(fp8_gemv_reference(x[:, :k], values, scale), np.float32)
    assert np.max(np.abs(np.asarray(got, np.float32) - gate)) > 0.1 * np.max(np.abs(gate))


def test_swiglu_wants_a_gate_up_row_and_no_norm():
    x, values, scale = random_inputs(0, 1, 32, 64)
    with pytest.raises(ValueError, match="2K"):
        fp8_gemv(x, values, scale, swiglu=True, interpret=True)
    with pytest.raises(ValueError, match="norm"):
        fp8_gemv(jnp.concatenate([x, x], 1), values, scale, jnp.ones((64,), x.dtype),
                 swiglu=True, interpret=True)


def test_norm_weight_must_match_x():
    x, values, scale = random_inputs(0, 1, 32, 64)
    with pytest.raises(ValueError, match="norm_weight"):
        fp8_gemv(x, values, scale, jnp.ones((63,), jnp.bfloat16), interpret=True)
    with pytest.raises(ValueError, match="norm_weight"):
        fp8_gemv(x, values, scale, jnp.ones((64,), jnp.float32), interpret=True)


def test_default_splits():
    """The 8B's projections (gate/up, o, down, qkv) at the default tiles: gate/up's N tiles
    need no split, o's and down's get the most; a short K is never split below four K tiles a
    split."""
    shapes = ((28672, 4096), (4096, 4096), (4096, 14336), (6144, 4096))
    assert [gemv.default_splits(n, k, *gemv.DEFAULT_TILE) for n, k in shapes] == [1, 4, 4, 2]
    assert gemv.default_splits(64, 1024, 32, 256) == 1


def test_reference_matches_numpy():
    x, values, scale = random_inputs(1, 5, 96, 160, jnp.float32)
    want = (np.asarray(x, np.float64) @ np.asarray(values).astype(np.float32).T.astype(np.float64)
            * np.asarray(scale)[None, :])
    got = np.asarray(fp8_gemv_reference(x, values, scale))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


# -- quant.linear's routing ---------------------------------------------------------------
def projection(num_tokens, out=(2, 48), k=96, dtype=jnp.bfloat16):
    """x [T, K] and an Fp8Weight with two output axes (a gate/up's [K, 2, I])."""
    rng = np.random.default_rng(num_tokens)
    x = jnp.asarray(rng.standard_normal((num_tokens, k)), jnp.float32).astype(dtype)
    w = quantize_fp8(jnp.asarray(rng.standard_normal((k, *out)) * 0.2, jnp.float32).astype(dtype))
    return x, w


def gemv_of(x, w):
    """The GEMV's reference on w's output axes flattened."""
    y = fp8_gemv_reference(x, w.values.reshape(-1, w.values.shape[-1]), w.scale.reshape(-1))
    return y.reshape(x.shape[0], *w.values.shape[:-1])


@pytest.fixture
def gemv_calls(monkeypatch):
    """Counts the calls linear makes to the GEMV (its reference: the CPU's path)."""
    calls = []

    def counted(*args):
        calls.append(args[0].shape)
        return fp8_gemv_reference(*args)
    monkeypatch.setattr(gemv, "fp8_gemv_reference", counted)
    return calls


@pytest.mark.parametrize("num_tokens", sorted({1, GEMV_MAX_TOKENS}))
def test_linear_runs_few_tokens_through_the_gemv(num_tokens, gemv_calls):
    x, w = projection(num_tokens)
    got = linear(x, w)
    assert gemv_calls == [x.shape]
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(gemv_of(x, w), np.float32))
    exact = np.einsum("tk,kgo->tgo", np.asarray(x, np.float32), np.asarray(dequantize(w)))
    err = np.linalg.norm((np.asarray(got, np.float32) - exact).reshape(num_tokens, -1), axis=1)
    # W8A16: the dequantised product to bf16 rounding (W8A8 adds x's float8 rounding, ~3%)
    assert np.all(err / np.linalg.norm(exact.reshape(num_tokens, -1), axis=1) < 1e-2)


def test_linear_runs_more_tokens_as_w8a8(gemv_calls):
    x, w = projection(GEMV_MAX_TOKENS + 1)
    np.testing.assert_array_equal(np.asarray(linear(x, w), np.float32),
                                  np.asarray(quant._fp8_w8a8(x, w), np.float32))
    assert not gemv_calls


def test_dense_mlp_few_tokens_runs_both_projections_through_the_gemv(gemv_calls):
    """The down GEMV reads the gate/up product whole (SwiGLU inside it)."""
    x, w_gate_up = projection(GEMV_MAX_TOKENS, out=(2, 48), k=64)
    _, w_down = projection(GEMV_MAX_TOKENS, out=(64,), k=48)
    got = dense_mlp({"w_gate_up": w_gate_up, "w_down": w_down}, x, None)
    assert gemv_calls == [(GEMV_MAX_TOKENS, 64), (GEMV_MAX_TOKENS, 96)]
    gate_up = gemv_of(x, w_gate_up)
    want = gemv_of(jax.nn.silu(gate_up[:, 0]) * gate_up[:, 1], w_down)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_norm_linear_takes_the_norm_into_the_gemv(gemv_calls):
    """One token and an FP8 weight: norm_linear is one GEMV call with the norm (its weight
    passed along), equal to the norm then linear; more tokens run the norm apart; a plain
    weight at one token takes the RMS on its product (within bf16's roundings of the norm
    then the GEMM; x far from unit RMS, so a lost RMS is off by far more)."""
    x, w = projection(GEMV_MAX_TOKENS)
    weight = jnp.asarray(np.linspace(0.5, 1.5, x.shape[1]), x.dtype)
    got = quant.norm_linear(x * 9, weight, 1e-5, w)
    assert gemv_calls == [x.shape]
    want = linear(quant.rms_norm(x * 9, weight, 1e-5), w)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    gemv_calls.clear()
    xs, _ = projection(GEMV_MAX_TOKENS + 1)
    np.testing.assert_array_equal(np.asarray(quant.norm_linear(xs, weight, 1e-5, w)),
                                  np.asarray(linear(quant.rms_norm(xs, weight, 1e-5), w)))
    assert not gemv_calls
    plain = dequantize(w, jnp.bfloat16)
    got = np.asarray(quant.norm_linear(x * 9, weight, 1e-5, plain), np.float32)
    want = np.asarray(linear(quant.rms_norm(x * 9, weight, 1e-5), plain), np.float32)
    assert not gemv_calls
    np.testing.assert_allclose(got, want, rtol=2 ** -6, atol=2 ** -6 * np.abs(want).max())


def test_one_token_fp8_forward_norms_inside_the_gemvs(monkeypatch):
    """A tiny FP8 Llama's one-token step: every layer's qkv and gate/up GEMVs take their input
    norm (o and down none), and the logits equal those of the same step with the norms run
    apart (random norm weights, so a norm dropped or applied twice would show)."""
    from jaxllm.loader.dummy import dummy_params
    from jaxllm.models import layers, transformer
    from jaxllm.models.args import ModelArgs
    from jaxllm.models.batch import StepBatch
    from jaxllm.models.fused import fuse_params

    args = ModelArgs(architecture="LlamaForCausalLM", vocab_size=256, hidden_size=64,
                     intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                     rms_norm_eps=1e-5, max_position_embeddings=128)
    params = dummy_params(args, jnp.bfloat16, seed=3)
    rng = np.random.default_rng(0)
    for layer in params["layers"]:
        for name in ("attn_norm", "mlp_norm"):
            layer[name] = jnp.asarray(rng.uniform(0.2, 3.0, 64), jnp.bfloat16)
    params = quant.quantize_params_fp8(fuse_params(params, 2))
    cache = [(jnp.asarray(rng.standard_normal(cache_shape(4, 8, 2, 16)), jnp.bfloat16),) * 2
             for _ in range(2)]
    i32 = lambda *v: jnp.asarray(v, jnp.int32)
    batch = StepBatch(token_ids=i32(17), positions=i32(5), slot_mapping=i32(13),
                      block_tables=i32([1, 2]), cu_q_lens=i32(0, 1), kv_lens=i32(6),
                      num_seqs=i32(1), logits_indices=i32(0))
    norms, swiglus = [], []
    real = gemv.fp8_gemv_reference

    def recorded(x, values, scale, norm_weight=None, eps=1e-6, swiglu=False):
        norms.append(norm_weight is not None)
        swiglus.append(swiglu)
        return real(x, values, scale, norm_weight, eps, swiglu)
    monkeypatch.setattr(gemv, "fp8_gemv_reference", recorded)
    fused, _ = transformer.forward(params, cache, batch, args=args)
    assert norms == [True, False, True, False] * 2  # qkv, o, gate/up, down
    assert swiglus == [False, False, False, True] * 2
    apart = lambda x, weight, eps, w, quantized=None, unscaled=False: linear(  # noqa: E731
        quant.rms_norm(x, weight, eps), w)
    monkeypatch.setattr(transformer, "norm_linear", apart)
    monkeypatch.setattr(layers, "norm_linear", apart)
    norms.clear()
    want, _ = transformer.forward(params, cache, batch, args=args)
    assert norms == [False] * 8
    np.testing.assert_array_equal(np.asarray(fused), np.asarray(want))


def test_one_token_fp8_mlp_on_the_gpu_is_two_gemvs(monkeypatch):
    """The GPU's path: a one-token FP8 MLP is the gate/up GEMV and the down GEMV, SwiGLU inside
    the second (no silu of XLA's between them), and its output that of the MLP run apart (the
    kernels in interpret mode)."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    x, w_gate_up = projection(1, out=(2, 48), k=64)
    _, w_down = projection(1, out=(64,), k=48)
    layer = {"w_gate_up": w_gate_up, "w_down": w_down}
    eqns = jax.make_jaxpr(lambda x: dense_mlp(layer, x, None))(x).jaxpr.eqns
    assert [e.params.get("name") for e in eqns if e.primitive.name in ("jit", "pjit")] == [
        "fp8_gemv", "fp8_gemv"]  # jax.nn.silu apart would be a third, named silu
    monkeypatch.setattr(gemv, "fp8_gemv", functools.partial(fp8_gemv, interpret=True))
    gate_up = linear(x, w_gate_up)
    want = linear(jax.nn.silu(gate_up[:, 0]) * gate_up[:, 1], w_down)
    np.testing.assert_allclose(np.asarray(dense_mlp(layer, x, None), np.float32),
                               np.asarray(want, np.float32), rtol=0.02,
                               atol=0.02 * float(np.abs(np.asarray(want, np.float32)).max()))


def test_linear_runs_the_kernel_on_the_gpu(monkeypatch):
    """On the GPU's backend linear calls the kernel itself (here in interpret mode)."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(gemv, "fp8_gemv", functools.partial(fp8_gemv, interpret=True))
    x, w = projection(GEMV_MAX_TOKENS)
    np.testing.assert_allclose(np.asarray(linear(x, w), np.float32),
                               np.asarray(gemv_of(x, w), np.float32), rtol=RTOL[jnp.bfloat16])


def test_one_device_only():
    """On a mesh of several devices FP8 keeps W8A8 (GSPMD partitions its dot; the kernel sees
    w's output axes as one)."""
    x, _ = projection(1)
    assert fp8_gemv_applies(x)
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((2,), ("tensor",))):
        assert not fp8_gemv_applies(x)


# -- CUDA lowering ------------------------------------------------------------------------
def test_kernel_lowers_for_cuda():
    sds = jax.ShapeDtypeStruct
    for m, n, k, dtype, tiles in [(1, 6144, 4096, jnp.bfloat16, {}),
                                  (8, 28672, 4096, jnp.bfloat16, {}),
                                  (1, 4096, 14336, jnp.float16, dict(block_n=64, block_k=512)),
                                  (3, 4096, 4096, jnp.float32, dict(splits=8, num_warps=8))]:
        text = lower_for_h200(functools.partial(fp8_gemv, **tiles), sds((m, k), dtype),
                              sds((n, k), FP8), sds((n,), jnp.float32))
        assert "fp8_gemv" in text and "triton" in text
    text = lower_for_h200(functools.partial(fp8_gemv, swiglu=True), sds((1, 28672), jnp.bfloat16),
                          sds((4096, 14336), FP8), sds((4096,), jnp.float32))  # down
    assert "fp8_gemv" in text
    for n in (28672, 6144):  # gate/up (one split: the kernel's RMS), qkv (the wrapper's)
        text = lower_for_h200(functools.partial(fp8_gemv, eps=1e-5), sds((1, 4096), jnp.bfloat16),
                              sds((n, 4096), FP8), sds((n,), jnp.float32),
                              sds((4096,), jnp.bfloat16))
        assert "fp8_gemv" in text and "triton" in text


def test_linear_lowers_to_the_gemv_for_few_tokens(monkeypatch):
    """The GPU's path traced here: the kernel up to GEMV_MAX_TOKENS tokens (no FP8 dot, no
    activation quantisation), the FP8 dot past it."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    w = quantize_fp8(jnp.zeros((512, 2, 768), jnp.bfloat16))
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), w)
    for tokens in (1, GEMV_MAX_TOKENS, GEMV_MAX_TOKENS + 1):
        text = lower_for_h200(linear, jax.ShapeDtypeStruct((tokens, 512), jnp.bfloat16), shapes)
        fp8_dots = [line for line in text.splitlines()
                    if "stablehlo.dot_general" in line and "f8E4M3FN" in line]
        if tokens <= GEMV_MAX_TOKENS:
            assert "fp8_gemv" in text and not fp8_dots
        else:
            assert "fp8_gemv" not in text and len(fp8_dots) == 1


# -- the engine: a one-token bucket where the GEMV runs -------------------------------------
def test_an_fp8_engine_runs_one_token_steps_through_the_gemv(tiny_llama_dir, gemv_calls):
    """FP8 weights on one device get a one-token bucket, where a lone one-token prompt's step
    runs the GEMV (W8A16): its logprobs are closer to the bf16 model's than those of the same
    prompts run together (a 16-token bucket: W8A8, which rounds the activations to float8 too).
    A bf16 engine keeps the 16-token bucket first."""
    from jaxllm import LLM, SamplingParams

    kw = dict(max_model_len=64, max_num_seqs=8, enforce_eager=True)
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=20)
    prompts = [{"prompt_token_ids": [t]} for t in (5, 77, 140, 201)]
    plain = LLM(tiny_llama_dir, **kw)
    assert plain.llm_engine.runner.buckets[0] == 16
    exact = plain.generate(prompts, params, use_tqdm=False)
    del plain
    llm = LLM(tiny_llama_dir, quantization="fp8", **kw)
    assert llm.llm_engine.runner.buckets[:2] == [1, 16]
    together = llm.generate(prompts, params, use_tqdm=False)
    assert not gemv_calls
    alone = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    assert gemv_calls  # traced for the one-token bucket

    def error(outs):
        """Mean |logprob - bf16's| over the tokens both top-20s hold."""
        diffs = []
        for out, ref in zip(outs, exact):
            got, want = out.outputs[0].logprobs[0], ref.outputs[0].logprobs[0]
            diffs += [abs(got[t].logprob - want[t].logprob) for t in set(got) & set(want)]
        assert len(diffs) >= 10 * len(outs)
        return float(np.mean(diffs))

    gemv_err, w8a8_err = error(alone), error(together)
    print(f"mean |logprob error| vs bf16: W8A16 {gemv_err:.4f}, W8A8 {w8a8_err:.4f}")
    assert gemv_err < w8a8_err and gemv_err < 0.05


@pytest.mark.parametrize("kernel", ["fp8", "int4"])
def test_gemv_report_writes_the_kernels_triton_ir(tmp_path, kernel):
    """benchmarks/experiments/gemv_report.py's jax half (the compile needs the triton package):
    the Triton IR of one GEMV call at the 8B's gate/up shape."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "experiments",
                                                       "gemv_report.py"), "--kernel", kernel,
                          "--k", "4096", "--n", "28672", "--out", str(tmp_path)], cwd=root,
                         capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=root))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    ttir = (tmp_path / "kernel.ttir").read_text()
    assert f"{kernel}_gemv" in ttir and "tt.func" in ttir and "scf.for" in ttir


@pytest.mark.parametrize("weights", ["fp8", "int4"])
def test_gemv_gpu_script_checks_and_times_every_main_variant(tmp_path, weights):
    """benchmarks/experiments/gemv_gpu.py --cpu (interpret mode, wall time): every main variant
    (the GEMV, bf16, XLA's own dot; FP8 with its norm inside too) passes its reference check
    and gets a time; the sweep is left out by the budget. int4's sweep is only num_stages'
    (--sweep), the other tiles held at the defaults'; the swept kernel is checked at each of
    the sweep's num_stages on a ragged shape first."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sweep = ["--sweep", "num_stages=1,2"] if weights == "int4" else []
    out = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "experiments",
                                                       "gemv_gpu.py"), "--weights", weights,
                          "--cpu", "--budget-s", "0", "--out", str(tmp_path), *sweep], cwd=root,
                         capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=root))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    with open(tmp_path / f"gemv_{weights}.json") as f:
        report = json.load(f)
    ragged = [r for r in report["rows"] if r.get("ragged")]
    assert [r["num_stages"] for r in ragged] == ([1, 2] if sweep else [1])
    assert all(r["err"] < 1e-2 for r in ragged)
    timed = [r for r in report["rows"] if not r.get("skipped") and not r.get("ragged")]
    assert report["errors"] == 0 and all(r["err"] < 1e-2 and r["us"] > 0 for r in timed)
    kinds = {"fp8": {"bf16", "fp8_gemv", "fp8_gemv_norm", "xla_w8a16"},
             "int4": {"bf16", "int4_matmul", "int4_gemv", "xla_int4"}}[weights]
    assert {r["kind"] for r in timed} == kinds
    skipped = [r for r in report["rows"] if r.get("skipped")]
    assert skipped and all(r["sweep"] for r in skipped)
    if sweep:  # the default (1 stage) timed as a main variant; 2 stages a projection left
        assert sorted((r["proj"], r["num_stages"], r["block_n"]) for r in skipped) == [
            ("down", 2, 128), ("qkv", 2, 128)]
