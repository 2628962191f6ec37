"""A GPTQ-format checkpoint by round-to-nearest (RTN): every decoder linear quantised to 4 bits
per group of input rows, written as GPTQ's `qweight`/`qzeros`/`scales`/`g_idx` (v1 format:
zeros stored minus one), for accuracy tests of the int4 path where no real GPTQ checkpoint is at
hand. No Hessian, so it is worse than real GPTQ at the same size.

    python -m jaxllm.loader.gptq_writer MODEL_DIR OUT_DIR [--group-size 128] [--asym] [--desc-act]
"""

from __future__ import annotations

import argparse

import numpy as np

from jaxllm.loader.safetensors_io import iter_tensors, safetensors_files, write_checkpoint

_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def rtn_quantize(w: np.ndarray, group: int, sym: bool, perm: np.ndarray | None):
    """w [N, K] (HF) -> (q [K, N] 0..15, zeros [K/g, N], scales [K/g, N], g_idx [K]); groups are
    formed over the input rows in `perm` order (GPTQ's act order), or in order."""
    wt = w.astype(np.float32).T  # [K, N]
    k = wt.shape[0]
    order = np.arange(k) if perm is None else perm
    g_idx = np.empty(k, np.int32)
    g_idx[order] = np.arange(k) // group
    grouped = wt[order].reshape(k // group, group, -1)
    if sym:  # GPTQ's symmetric grid: [-max, max] over 15 steps, zero point 8
        scales = 2 * np.abs(grouped).max(axis=1) / 15
        zeros = np.full_like(scales, 8)
    else:
        lo, hi = np.minimum(grouped.min(axis=1), 0), np.maximum(grouped.max(axis=1), 0)
        scales = (hi - lo) / 15
        zeros = np.round(-lo / np.where(scales == 0, 1, scales))
    scales = np.where(scales == 0, 1e-8, scales)
    q = np.clip(np.round(wt / scales[g_idx]) + zeros[g_idx], 0, 15)
    return q.astype(np.uint8), zeros.astype(np.uint8), scales.astype(np.float16), g_idx


def pack_gptq(q: np.ndarray, zeros: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """GPTQ's packing: qweight [K/8, N], nibble i of word r = row 8r + i; qzeros [K/g, N/8],
    nibble i of word c = column 8c + i, each zero stored minus one."""
    k, n = q.shape
    rows = q.astype(np.uint32).reshape(k // 8, 8, n)
    qweight = sum(rows[:, i] << np.uint32(4 * i) for i in range(8))
    z = ((zeros.astype(np.int32) - 1) & 0xF).astype(np.uint32).reshape(zeros.shape[0], -1, 8)
    qzeros = sum(z[:, :, i] << np.uint32(4 * i) for i in range(8))
    return qweight.astype(np.uint32).view(np.int32), qzeros.astype(np.uint32).view(np.int32)


def write_rtn_gptq(model_dir: str, out_dir: str, group_size: int = 128, sym: bool = True,
                   desc_act: bool = False, seed: int = 0) -> str:
    """Writes OUT_DIR: config.json with GPTQ's quantization_config, the quantised safetensors,
    and the tokenizer and generation files copied. desc_act: groups over a random permutation
    of the input rows (the shape of GPTQ's act-order checkpoints; the same one for every linear
    reading the same input, as GPTQ's is)."""
    rng = np.random.default_rng(seed)
    perms: dict[tuple[str, int], np.ndarray] = {}
    tensors = {}
    for path in safetensors_files(model_dir):
        for name, host in iter_tensors(path):
            linear = name.rsplit(".", 2)
            if len(linear) == 3 and linear[1] in _LINEARS and linear[2] == "weight":
                base = name[:-len(".weight")]
                key = (base.rsplit(".", 2)[0], host.shape[1], linear[1] in ("o_proj", "down_proj"))
                perm = perms.setdefault(key, rng.permutation(host.shape[1])) if desc_act else None
                q, zeros, scales, g_idx = rtn_quantize(np.asarray(host), group_size, sym, perm)
                qweight, qzeros = pack_gptq(q, zeros)
                tensors.update({f"{base}.qweight": qweight, f"{base}.qzeros": qzeros,
                                f"{base}.scales": scales, f"{base}.g_idx": g_idx})
            else:
                tensors[name] = np.asarray(host, np.float32 if host.dtype.itemsize == 2 and
                                           host.dtype != np.float16 else host.dtype)
    return write_checkpoint(model_dir, out_dir, tensors, {
        "quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": desc_act,
        "sym": sym, "checkpoint_format": "gptq"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--asym", action="store_true")
    parser.add_argument("--desc-act", action="store_true")
    args = parser.parse_args()
    write_rtn_gptq(args.model_dir, args.out_dir, args.group_size, not args.asym, args.desc_act)


if __name__ == "__main__":
    main()
