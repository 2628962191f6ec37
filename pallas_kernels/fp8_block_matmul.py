"""Block-scaled FP8 matmul (W8A8): the product of block-wise FP8 checkpoints (DeepSeek's and
Qwen3's releases) with their own scales, x quantised per token and K group, each group's FP8
product scaled on the fp32 accumulator.

  x        [M, K]   float8_e4m3fn: the activations a[m, k] ~ x[m, k] * x_scale[m, k // group]
  x_scale  [M, G]   float32, G = cdiv(K, group)
  w        [N, K]   float8_e4m3fn (K minor, as Hopper's FP8 tensor cores read it)
  w_scale  [N, G]   float32: the weight's [n, k] is w[n, k] * w_scale[n, k // group]; a checkpoint's
                    [cdiv(N, bn), G] block scales repeated over each block's rows
  ->       [M, N]   out_dtype
  out[m, n] = sum_g x_scale[m, g] w_scale[n, g] sum_{k in group g} x[m, k] w[n, k]

The scales are a row per output channel, not a row per block of channels, so that they follow
the values through whatever acts on output axes (q/k/v concatenated, gate/up stacked, an output
split across devices); at group 128 they cost 4 / 128 bytes a weight.

Programs: (M tile, N tile, K split), one group per loop step: an FP8 dot [BM, group] x
[group, BN] on the FP8 tensor cores (triton_fp8_dot: summed in the tensor core's accumulator
over the group, then promoted), times the tile's x scales (a column) and w scales (a row),
added to the fp32 accumulator. At decode the M x N tiles are too few programs to stream the
weight at full bandwidth, so K is split into ranges of whole groups whose fp32 partial products
the wrapper sums (quant_matmul's splits); a single split writes out_dtype directly. Loads past
M, N or K read 0 (a partial last group), every store is masked.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import triton_fp8_dot
from pallas_kernels.quant_matmul import num_k_splits
from pallas_kernels.split_sum import sum_splits

triton_fp8_dot.install()  # the FP8 dots on wgmma, not on fp16 mma.sync

FP8 = jnp.float8_e4m3fn
MIN_GROUP = 32  # the K of one FP8 tensor-core product (wgmma)


def group_scales(scale: jax.Array, group: int, k: int) -> jax.Array:
    """scale [..., G] -> [..., K]: each element's group's scale (the last group may be
    partial)."""
    return jnp.repeat(scale, group, axis=-1)[..., :k]


def fp8_block_matmul_reference(x, x_scale, w, w_scale, group: int,
                               out_dtype=jnp.bfloat16) -> jax.Array:
    """The contract, in fp32: both operands dequantised by their group scales, then one dot."""
    k = x.shape[1]
    xd = x.astype(jnp.float32) * group_scales(x_scale, group, k)
    wd = w.astype(jnp.float32) * group_scales(w_scale, group, k)
    return jnp.dot(xd, wd.T, precision=jax.lax.Precision.HIGHEST).astype(out_dtype)


def check_group(group: int) -> None:
    """Refuses a group (a checkpoint's block_k) the kernel cannot take."""
    if group % MIN_GROUP:
        raise ValueError(f"FP8 scale groups of {group} rows: the block-scaled FP8 kernel takes "
                         f"a multiple of {MIN_GROUP}.")


def _kernel(x_ref, xs_ref, w_ref, ws_ref, o_ref, *, group, block_m, block_n, groups_per_split):
    """o_ref [splits, M, N]: this split's groups' x @ w.T for one [BM, BN] tile."""
    (m_total, k_total), n_total = x_ref.shape, w_ref.shape[0]
    num_groups = xs_ref.shape[1]
    rows = pl.program_id(0) * block_m + jnp.arange(block_m, dtype=jnp.int32)
    cols = pl.program_id(1) * block_n + jnp.arange(block_n, dtype=jnp.int32)
    row_ok, col_ok = rows < m_total, cols < n_total
    offsets = jnp.arange(group, dtype=jnp.int32)
    zero = jnp.zeros((), FP8)  # Triton casts no integer to float8

    def step(g, acc):
        ks = g * group + offsets
        k_ok = ks < k_total
        xq = pltriton.load(x_ref.at[rows[:, None], ks[None, :]],
                           mask=row_ok[:, None] & k_ok[None, :], other=zero)  # [BM, group]
        wq = pltriton.load(w_ref.at[cols[:, None], ks[None, :]],
                           mask=col_ok[:, None] & k_ok[None, :], other=zero,
                           eviction_policy="evict_first")  # [BN, group], read once
        xs = pltriton.load(xs_ref.at[rows, g], mask=row_ok, other=0)  # [BM]
        ws = pltriton.load(ws_ref.at[cols, g], mask=col_ok, other=0)  # [BN]
        part = pltriton.dot(xq, wq, trans_b=True)  # [BM, BN] fp32
        return acc + part * xs[:, None] * ws[None, :]

    split = pl.program_id(2)
    first = split * groups_per_split
    last = jnp.minimum(first + groups_per_split, num_groups)
    acc = jax.lax.fori_loop(first, last, step, jnp.zeros((block_m, block_n), jnp.float32))
    pltriton.store(o_ref.at[split, rows[:, None], cols[None, :]], acc.astype(o_ref.dtype),
                   mask=row_ok[:, None] & col_ok[None, :])


@functools.partial(jax.jit, static_argnames=("group", "out_dtype", "block_m", "block_n",
                                             "num_warps", "num_stages", "splits", "interpret"))
def fp8_block_matmul(x, x_scale, w, w_scale, *, group: int, out_dtype=jnp.bfloat16,
                     block_m: int | None = None, block_n: int = 128, num_warps: int = 4,
                     num_stages: int = 3, splits: int | None = None,
                     interpret: bool = False) -> jax.Array:
    """The Pallas (Triton) kernel, `fp8_block_matmul_reference`'s contract. block_m: 16 rows up
    to 16 tokens, else 64; splits: K splits (default: quant_matmul.num_k_splits' count)."""
    (m, k), n = x.shape, w.shape[0]
    num_groups = pl.cdiv(k, group)
    check_group(group)
    if ((x.dtype, w.dtype) != (FP8, FP8) or w.shape[1] != k
            or (x_scale.shape, w_scale.shape) != ((m, num_groups), (n, num_groups))):
        raise ValueError(f"x {x.dtype}{list(x.shape)}, x_scale {list(x_scale.shape)}, w "
                         f"{w.dtype}{list(w.shape)}, w_scale {list(w_scale.shape)}: "
                         f"float8_e4m3fn [M, K] and [N, K], scales [M, {num_groups}] and "
                         f"[N, {num_groups}] (groups of {group}).")
    block_m = block_m or (16 if m <= 16 else 64)
    splits = splits or num_k_splits(m, k, n, block_m, block_n, block_k=group)
    groups_per_split = pl.cdiv(num_groups, splits)
    kernel = functools.partial(_kernel, group=group, block_m=block_m, block_n=block_n,
                               groups_per_split=groups_per_split)
    out = pl.pallas_call(
        kernel, grid=(pl.cdiv(m, block_m), pl.cdiv(n, block_n), splits),
        out_shape=jax.ShapeDtypeStruct((splits, m, n), out_dtype if splits == 1 else jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name="fp8_block_matmul",
    )(x, x_scale.astype(jnp.float32), w, w_scale.astype(jnp.float32))
    return out[0] if splits == 1 else sum_splits(out).astype(out_dtype)
