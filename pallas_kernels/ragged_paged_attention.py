"""Ragged paged attention: the queries of all scheduled tokens of all sequences, flattened, attend
causally to each sequence's K/V, which live in fixed-size pages named by a block table.

Shapes (letters as in the einsums):
  q            [T, Hq, D]                 t: token, h = k*g: query head, d: head dim
  k_cache      [N, P, Hkv, D]             N: pages (blocks), p: page size (block_size), k: KV head
  v_cache      [N, P, Hkv, D]
  kv_lens      [S] int32                  KV length of each sequence, this step's tokens included
  block_tables [S, B] int32               B: max pages per sequence
  cu_q_lens    [S + 1] int32              query start of each sequence in the flat batch
  num_seqs     [1] int32                  live sequences; the rest are padding (q_len 0)
Query i of sequence s sits at position kv_lens[s] - q_len[s] + i and sees KV positions <= its own.
Rows past cu_q_lens[num_seqs] are padding: their output is unspecified (finite).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_MASK_INIT = -1e30


def ragged_paged_attention_reference(q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens,
                                     num_seqs, *, sm_scale: float, sliding_window: int | None = None,
                                     soft_cap: float | None = None):
    """Pure jnp, fixed shapes (jittable): an online softmax scanned over the B page slots.

    Costs T * B * P regardless of the real lengths: the XLA fallback and the tests' reference.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    max_seqs, max_pages = block_tables.shape
    group = num_q_heads // num_kv_heads
    token = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(cu_q_lens[1:], token, side="right"), max_seqs - 1)
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    kv_len = kv_lens[seq]  # [T]
    q_pos = kv_len - q_lens[seq] + token - cu_q_lens[seq]  # [T]
    live = token < cu_q_lens[num_seqs[0]]
    qg = q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_dim) * sm_scale

    def page_step(carry, j):
        m, l, acc = carry
        page = block_tables[seq, j]  # [T]
        k = k_cache[page].astype(jnp.float32)  # [T, P, Hkv, D]
        v = v_cache[page].astype(jnp.float32)
        s = jnp.einsum("tkgd,tpkd->tkgp", qg, k)
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        kv_pos = j * page_size + jnp.arange(page_size, dtype=jnp.int32)  # [P]
        mask = (kv_pos[None, :] <= q_pos[:, None]) & (kv_pos[None, :] < kv_len[:, None])
        if sliding_window is not None:
            mask &= kv_pos[None, :] > q_pos[:, None] - sliding_window
        mask = (mask & live[:, None])[:, None, None, :]  # [T, 1, 1, P]
        m_new = jnp.maximum(m, jnp.max(jnp.where(mask, s, _MASK_INIT), axis=-1))
        p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
        alpha = jnp.exp(m - m_new)
        l = l * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + jnp.einsum("tkgp,tpkd->tkgd", p, v)
        return (m_new, l, acc), None

    init = (jnp.full((num_tokens, num_kv_heads, group), _MASK_INIT, jnp.float32),
            jnp.zeros((num_tokens, num_kv_heads, group), jnp.float32),
            jnp.zeros((num_tokens, num_kv_heads, group, head_dim), jnp.float32))
    (_, l, acc), _ = jax.lax.scan(page_step, init, jnp.arange(max_pages, dtype=jnp.int32))
    out = acc / jnp.maximum(l, 1e-30)[..., None]
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)
