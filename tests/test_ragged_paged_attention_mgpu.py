"""The Mosaic GPU (Hopper) prefill kernel on this CPU machine: its tile metadata, exactly, and
its lowering for CUDA. wgmma has no interpret mode here, so its numbers are checked on the GPU
(`python -m pallas_kernels.bench --sections correctness`)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import lower_for_h200

from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.ragged_paged_attention_mgpu import (kv_steps, max_tiles,
                                                        ragged_paged_attention_mgpu, supports,
                                                        tile_metadata)


def test_tile_metadata_exact():
    """Sequences of q_len 5, 0 (skipped), 35 (3 tiles of 16), 1, a dead slot; then the padding
    rows 41..47 as kv_len-0 tiles; the rest empty."""
    cu = jnp.array([0, 5, 5, 40, 41, 41], jnp.int32)
    kv_lens = jnp.array([10, 3, 35, 100, 7], jnp.int32)
    meta = tile_metadata(cu, kv_lens, jnp.array([4], jnp.int32), num_tokens=48, tile_tokens=16,
                         max_tiles=max_tiles(48, 5, 16))
    # seq, first token, tokens, first query position, kv_len
    expected = [[0, 0, 5, 5, 10], [2, 5, 16, 0, 35], [2, 21, 16, 16, 35], [2, 37, 3, 32, 35],
                [3, 40, 1, 99, 100], [0, 41, 7, -7, 0]]
    np.testing.assert_array_equal(np.asarray(meta)[:6], expected)
    assert (np.asarray(meta)[6:, 2] == 0).all() and meta.shape == (9, 5)


def test_tile_metadata_skips_a_live_sequence_without_keys():
    """kv_len 0 marks a sequence another kernel takes (a float8 cache's decodes and unstaged
    prefill): no tile, so its rows stay unwritten; the padding rows still get theirs."""
    cu = jnp.array([0, 5, 6, 20], jnp.int32)
    kv_lens = jnp.array([0, 40, 30], jnp.int32)
    meta = np.asarray(tile_metadata(cu, kv_lens, jnp.array([3], jnp.int32), num_tokens=24,
                                    tile_tokens=16, max_tiles=max_tiles(24, 3, 16)))
    np.testing.assert_array_equal(meta[:3], [[1, 5, 1, 39, 40], [2, 6, 14, 16, 30],
                                             [0, 20, 4, -4, 0]])
    assert (meta[3:, 2] == 0).all()


@pytest.mark.parametrize("seed", range(5))
def test_tile_metadata_covers_every_row_once(seed):
    rng = np.random.default_rng(seed)
    max_seqs, num_tokens, tile = 7, 96, 8
    num_seqs = int(rng.integers(0, max_seqs + 1))
    q_lens = rng.integers(0, 20, num_seqs)
    q_lens = q_lens * (q_lens.sum() <= num_tokens)  # fits
    cu = np.zeros(max_seqs + 1, np.int32)
    cu[1:num_seqs + 1] = np.cumsum(q_lens)
    cu[num_seqs + 1:] = cu[num_seqs]
    kv = np.zeros(max_seqs, np.int32)
    kv[:num_seqs] = q_lens + rng.integers(0, 50, num_seqs)
    meta = np.asarray(tile_metadata(jnp.asarray(cu), jnp.asarray(kv), jnp.array([num_seqs]),
                                    num_tokens=num_tokens, tile_tokens=tile,
                                    max_tiles=max_tiles(num_tokens, max_seqs, tile)))
    covered = np.zeros(num_tokens, int)
    for seq, tok0, ntok, qpos0, kv_len in meta:
        covered[tok0:tok0 + ntok] += 1
        live = tok0 < cu[num_seqs]
        if ntok and live:  # positions continue the sequence's context
            assert cu[seq] <= tok0 and tok0 + ntok <= cu[seq + 1] and kv_len == kv[seq]
            assert qpos0 == kv[seq] - q_lens[seq] + tok0 - cu[seq]
        elif ntok:
            assert kv_len == 0
    assert (covered == 1).all()


@pytest.mark.parametrize("q0,ntok,kv_len,expected", [
    (5, 5, 10, (1, 0)),       # 5 queries over 5 of context: one diagonal tile
    (130, 16, 146, (3, 2)),   # tiles 0-1 wholly below position 130, tile 2 masked
    (0, 16, 35, (1, 0)),
    (-7, 7, 0, (0, 0)),       # padding rows: no tile (was a masked loop from -1: a GPU hang)
    (-64, 16, 0, (0, 0)),
    (99, 0, 100, (0, 0))])    # a warpgroup without tokens
def test_kv_steps(q0, ntok, kv_len, expected):
    assert tuple(int(x) for x in kv_steps(jnp.int32(q0), jnp.int32(ntok), jnp.int32(kv_len),
                                          64)) == expected


def test_supports():
    q, cache = jnp.zeros((4, 32, 128), jnp.bfloat16), jnp.zeros((2, 8, 16, 128), jnp.bfloat16)
    assert supports(q, cache)
    assert not supports(q.astype(jnp.float32), cache.astype(jnp.float32))
    assert not supports(q, cache, sliding_window=64)
    assert not supports(jnp.zeros((4, 48, 128), jnp.bfloat16), cache)  # group 6
    with pytest.raises(ValueError, match="unsupported"):
        ragged_paged_attention_mgpu(q, cache[:, :, :4], cache[:, :, :4], jnp.zeros(2, jnp.int32),
                                    jnp.zeros((2, 4), jnp.int32), jnp.zeros(3, jnp.int32),
                                    jnp.ones(1, jnp.int32), sm_scale=0.1)


@pytest.mark.parametrize("group,head_dim,page_size,block_kv,num_stages", [
    (4, 128, 16, 128, 2), (4, 128, 64, 64, 3), (1, 64, 32, 64, 2), (8, 128, 8, 128, 2),
    (2, 64, 64, 128, 2)])
def test_lowers_for_cuda(group, head_dim, page_size, block_kv, num_stages):
    sds = jax.ShapeDtypeStruct
    num_kv_heads, max_seqs = 2, 5
    cache = sds((64, num_kv_heads, page_size, head_dim), jnp.bfloat16)
    args = (sds((300, group * num_kv_heads, head_dim), jnp.bfloat16), cache, cache,
            sds((max_seqs,), jnp.int32), sds((max_seqs, 12), jnp.int32),
            sds((max_seqs + 1,), jnp.int32), sds((1,), jnp.int32))
    fn = functools.partial(ragged_paged_attention_mgpu, sm_scale=0.1, block_kv=block_kv,
                           num_stages=num_stages)
    assert "mosaic_gpu" in lower_for_h200(fn, *args)


def test_dispatch():
    """implementation='mosaic' reaches this kernel (lowered for CUDA); a bad name or an
    unsupported call is a ValueError naming the limit; on this CPU machine the default is the
    Triton kernel (Mosaic needs a Hopper GPU)."""
    sds = jax.ShapeDtypeStruct
    cache = sds((64, 8, 16, 128), jnp.bfloat16)
    args = (sds((300, 32, 128), jnp.bfloat16), cache, cache, sds((5,), jnp.int32),
            sds((5, 12), jnp.int32), sds((6,), jnp.int32), sds((1,), jnp.int32))
    mosaic = functools.partial(ragged_paged_attention, sm_scale=0.1, implementation="mosaic")
    assert "mosaic_gpu" in lower_for_h200(mosaic, *args)
    auto = functools.partial(ragged_paged_attention, sm_scale=0.1)
    assert "mosaic_gpu" not in lower_for_h200(auto, *args)
    with pytest.raises(ValueError, match="must be None, 'triton' or 'mosaic'"):
        lower_for_h200(functools.partial(auto, implementation="cudnn"), *args)
    with pytest.raises(ValueError, match="sliding window"):
        lower_for_h200(functools.partial(mosaic, sliding_window=64), *args)
