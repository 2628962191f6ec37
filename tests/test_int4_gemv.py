"""The W4A16 int4 GEMV: the Pallas kernel in interpret mode (its inline-PTX blocks as their jnp
twins) against numpy's exact product on the unpacked weights, within the half2 partial sums'
roundings, and against quant_matmul's reference; x rows of any magnitude (the power-of-two row
scale); its K splits, its checks, its CUDA lowering with the PTX, and linear's routing."""

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import lower_for_h200

from jaxllm.models.quant import GEMV_MAX_TOKENS, Int4Weight, dequantize, linear

from pallas_kernels import int4_gemv as gemv
from pallas_kernels.int4_gemv import int4_gemv
from pallas_kernels.quant_matmul import int4_matmul_reference, pack_int4

# unit roundoff of x's dtype: one rounding errs by at most that, relatively
UNIT = {jnp.bfloat16: 2.0 ** -8, jnp.float16: 2.0 ** -11, jnp.float32: 2.0 ** -24}


def random_inputs(seed, m, k, n, group, dtype):
    """x never zero (rows of different magnitudes), 4-bit values over 0..15, scales over a
    decade, asymmetric zero points over 0..15; -> (the kernel's args, q [K, N])."""
    rng = np.random.default_rng(seed)
    x = (rng.uniform(0.1, 2.0, (m, k)) * rng.choice([-1.0, 1.0], (m, k))
         * rng.choice([0.1, 1.0, 10.0], (m, 1)))
    q = rng.integers(0, 16, (k, n))
    scales = rng.uniform(0.005, 0.05, (k // group, n))
    zeros = rng.integers(0, 16, (k // group, n)).astype(np.uint8)
    args = (jnp.asarray(x, jnp.float32).astype(dtype), jnp.asarray(pack_int4(q)),
            jnp.asarray(scales, jnp.float32).astype(dtype), jnp.asarray(zeros))
    return args, q


def check(got, args, q):
    """Element by element, against numpy's exact product on q (the scales as x's dtype holds
    them): the output's one rounding, up to four fp16 roundings in a half2 lane (each under
    2^-11 of the lane's |n x| terms, so 2^-9 of them in all), the fp32 sums; and far from the
    product without zero points (their share applied). Against the reference too (which
    rounds each weight to x's dtype: one more unit a term)."""
    x, _, scales, zeros = args
    group = q.shape[0] // scales.shape[0]
    u = UNIT[x.dtype.type]
    s = np.repeat(np.asarray(scales, np.float64), group, 0)
    z = np.repeat(np.asarray(zeros, np.int64), group, 0)
    x64 = np.asarray(x, np.float64)
    exact = x64 @ ((q - z) * s)
    halves = 2.0 ** -9 * (np.abs(x64) @ (q * s))
    sums = q.shape[0] * 2.0 ** -23 * (np.abs(x64) @ ((q + z) * s))
    got64 = np.asarray(got, np.float64)
    assert np.all(np.abs(got64 - exact) <= u * np.abs(exact) + halves + sums)
    assert np.max(np.abs(got64 - x64 @ (q * s))) > 10 * np.max(u * np.abs(exact) + halves + sums)
    want = np.asarray(int4_matmul_reference(*args), np.float64)
    terms = np.abs(x64) @ np.abs((q - z) * s)
    assert np.all(np.abs(got64 - want) <= u * (terms + np.abs(got64) + np.abs(want))
                  + halves + sums)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("m,k,n,group,tiles", [
    (1, 128, 200, 32, dict(block_n=64)),  # one chunk of four groups; N ragged
    (3, 384, 200, 64, dict()),  # the defaults: block_n 128 over 200 columns
    (1, 1024, 200, 128, dict(splits=3, num_stages=3)),  # 8 chunks in 3 + 3 + 2, pipelined
    (2, 1024, 96, 1024, dict(block_n=32, splits=3)),  # one group, cut by the splits
    (1, 384, 200, 384, dict(block_n=256, splits=1)),  # one group, one split
    (3, 384, 72, 128, dict(block_n=16, splits=3)),  # a chunk a split
])
def test_kernel_matches_reference_and_numpy(m, k, n, group, tiles, dtype):
    args, q = random_inputs(m * k + n + group, m, k, n, group, dtype)
    got = int4_gemv(*args, interpret=True, **tiles)
    assert got.shape == (m, n) and got.dtype == dtype
    check(got, args, q)


def test_a_split_count_leaving_ranges_empty_is_lowered():
    """8 chunks in 5 splits would leave one empty (2 + 2 + 2 + 2 + 0): 4 run, same product."""
    args, q = random_inputs(7, 1, 1024, 40, 64, jnp.float32)
    got = int4_gemv(*args, splits=5, block_n=32, interpret=True)
    check(got, args, q)
    assert gemv._whole_splits(8, 5) == 4 and gemv._whole_splits(8, 3) == 3
    assert gemv._whole_splits(3, 7) == 3


def test_default_splits():
    """The 8B's projections at the default block_n (the H200 sweep's best splits at 128
    columns): qkv's 48 N tiles and o's 32 take 32 splits (a chunk each), gate/up's 224 take 8,
    down's 32 take 28 (the 32 that 1,024 programs ask for, made whole over 112 chunks); a short
    K is never split past its chunks."""
    shapes = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))
    assert [gemv.default_splits(n, k, gemv.DEFAULT_BLOCK_N) for n, k in shapes] == [32, 32, 8, 28]
    assert gemv.default_splits(64, 384, 64) == 3 and gemv.default_splits(200, 128, 128) == 1


@pytest.mark.parametrize("magnitude", [3e4, 1e-6])
def test_rows_far_from_unit_scale_neither_overflow_nor_underflow(magnitude):
    """Rows whose products would pass fp16's 65504 (x ~ 3e4, n up to 15) or fall under its
    normal range (x ~ 1e-6) keep the same relative error: the row scale brings them to 2^9."""
    args, q = random_inputs(5, 2, 256, 64, 64, jnp.float32)
    args = (args[0] * magnitude, *args[1:])
    check(int4_gemv(*args, interpret=True), args, q)


def test_each_split_scales_x_by_its_own_range():
    """x's first half ~3e4 against zero weights (n = z = 0: an exact 0), its second ~1e-6: the
    second split keeps x's relative precision only if its scale comes from its own range (the
    whole row's would take its products below fp16's normal range)."""
    args, q = random_inputs(11, 1, 1024, 64, 128, jnp.float32)
    x, _, scales, zeros = args
    x = x.at[:, :512].multiply(3e4 / jnp.max(jnp.abs(x[:, :512]))).at[:, 512:].multiply(1e-6)
    q[:512] = 0
    zeros = zeros.at[:4].set(0)
    args = (x, jnp.asarray(pack_int4(q)), scales, zeros)
    check(int4_gemv(*args, splits=2, block_n=64, interpret=True), args, q)


@pytest.mark.parametrize("group", [16, 96])
def test_groups_that_do_not_tile_a_chunk_are_refused(group):
    args, _ = random_inputs(0, 1, 384, 32, group, jnp.bfloat16)
    with pytest.raises(ValueError, match="32, 64 or a multiple of 128"):
        int4_gemv(*args, interpret=True)


@pytest.mark.parametrize("shapes,tiles", [
    (((1, 200), (16, 64), (2, 64), (2, 64)), {}),  # K not 8 x qweight's rows
    (((1, 256), (32, 64), (3, 64), (3, 64)), {}),  # a group that does not divide K
    (((1, 256), (32, 64), (2, 64), (2, 64)), dict(block_n=48)),
    (((1, 256), (32, 64), (2, 64), (2, 64)), dict(block_n=8)),
    (((1, 256), (32, 64), (2, 64), (2, 64)), dict(splits=-1)),
])
def test_bad_arguments_raise(shapes, tiles):
    dtypes = (jnp.bfloat16, jnp.int32, jnp.bfloat16, jnp.uint8)
    args = [jnp.zeros(s, d) for s, d in zip(shapes, dtypes)]
    with pytest.raises(ValueError):
        int4_gemv(*args, interpret=True, **tiles)


def test_kernel_lowers_for_cuda():
    """The 8B's projections at one token, group 128, and a group of 32 (several parts a chunk)
    at three fp32 rows."""
    sds = jax.ShapeDtypeStruct
    for m, k, n, group, dtype, tiles in [
            (1, 4096, 6144, 128, jnp.bfloat16, {}), (1, 4096, 4096, 128, jnp.float16, {}),
            (1, 14336, 4096, 128, jnp.bfloat16, dict(block_n=256, num_warps=8)),
            (1, 14336, 4096, 128, jnp.float16, dict(block_n=64, splits=3, num_stages=3)),
            (3, 4096, 4096, 32, jnp.float32, {})]:
        text = lower_for_h200(functools.partial(int4_gemv, **tiles), sds((m, k), dtype),
                              sds((k // 8, n), jnp.int32), sds((k // group, n), dtype),
                              sds((k // group, n), jnp.uint8))
        assert "int4_gemv" in text and "triton" in text


# -- the engine's routing: one-token steps through the GEMV ---------------------------------
def int4_weight(k: int, out: tuple, group: int = 128) -> Int4Weight:
    (_, *packed), _ = random_inputs(k, 1, k, math.prod(out), group, jnp.bfloat16)
    qweight, scales, zeros = (a.reshape(a.shape[0], *out) for a in packed)
    return Int4Weight(qweight, scales, zeros, None, k)


def test_linear_lowers_to_the_gemv_for_one_token(monkeypatch):
    """The GPU's path traced here: the GEMV up to GEMV_MAX_TOKENS tokens, the tensor-core
    kernel past it."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    w = int4_weight(512, (2, 96))
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), w)
    for tokens in (1, GEMV_MAX_TOKENS, GEMV_MAX_TOKENS + 1):
        text = lower_for_h200(linear, jax.ShapeDtypeStruct((tokens, 512), jnp.bfloat16), shapes)
        kernels = set(re.findall(r'name = "(int4_\w+)"', text))  # the Triton calls' names
        assert kernels == {"int4_gemv" if tokens <= GEMV_MAX_TOKENS else "int4_matmul"}


def test_linear_one_token_on_the_gpu_path_matches_the_reference(monkeypatch):
    """linear's one-token GPU path (the kernel in interpret mode) agrees with the reference on
    w's output axes flattened back."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(gemv, "int4_gemv", functools.partial(int4_gemv, interpret=True))
    w = int4_weight(256, (2, 48), group=64)
    x = jnp.asarray(np.random.default_rng(3).normal(size=(1, 256)), jnp.bfloat16)
    want = dequantize(w).astype(np.float32)
    got = np.asarray(linear(x, w), np.float32)
    exact = np.einsum("tk,kgo->tgo", np.asarray(x, np.float32), np.asarray(want))
    np.testing.assert_allclose(got, exact, rtol=2e-2, atol=2e-2 * np.abs(exact).max())


def test_an_int4_engine_gets_the_one_token_bucket(tiny_qwen3_dir, tmp_path):
    """A GPTQ checkpoint's engine on one device starts with a one-token bucket (its GEMV's),
    and a lone prompt's greedy tokens there match the same prompt run beside others."""
    from jaxllm import LLM, SamplingParams
    from jaxllm.loader.gptq_writer import write_rtn_gptq

    out = write_rtn_gptq(tiny_qwen3_dir, str(tmp_path / "gptq"), group_size=32)
    llm = LLM(out, max_model_len=64, max_num_seqs=4, enforce_eager=True)
    assert llm.llm_engine.runner.buckets[:2] == [1, 16]
    params = SamplingParams(temperature=0.0, max_tokens=4)
    prompts = [{"prompt_token_ids": [t]} for t in (5, 77, 140)]
    together = llm.generate(prompts, params, use_tqdm=False)
    alone = llm.generate(prompts[:1], params, use_tqdm=False)
    assert alone[0].outputs[0].token_ids == together[0].outputs[0].token_ids
