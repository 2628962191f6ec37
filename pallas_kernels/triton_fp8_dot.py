"""Float8 dots of Pallas (Triton) kernels on Hopper's FP8 tensor cores.

Triton runs a float8 x float8 -> fp32 dot as wgmma only when the dot allows the tensor core's
own accumulator (narrower than fp32) over some of its K before each promotion to fp32
(`max_num_imprecise_acc`); otherwise it widens both operands to fp16 and runs mma.sync
(F2FP + HMMA in the SASS: the fp16 rate, and a conversion per element). Triton's own frontend
sets it for float8 dots; jax's Pallas lowering does not, so its float8 dots never reach wgmma.
`install()` makes the lowering pass the dot's K: each dot's products are summed in the tensor
core and promoted once, as DeepSeek's FP8 GEMMs do every 128 elements of K (the block-scaled
kernel's dots span one 128-row scale group). Other dtypes are left as they were.

jax is pinned (pyproject.toml), so the private lowering module this wraps does not move under
it; tests/test_fp8_block_matmul.py checks the attribute on the lowered Triton IR.
"""

from __future__ import annotations

import functools

from jax._src.lib.mlir import ir
from jax._src.pallas.triton import lowering

_FLOAT8 = (ir.Float8E4M3FNType, ir.Float8E5M2Type)


def _with_fp8_accumulation(dot):
    @functools.wraps(dot)
    def fp8_dot(a, b, c, **kw):
        a_type = ir.RankedTensorType(a.type)
        if isinstance(a_type.element_type, _FLOAT8):
            kw.setdefault("max_num_imprecise_acc", a_type.shape[-1])  # the dot's K
        return dot(a, b, c, **kw)

    fp8_dot.wraps_fp8_accumulation = True
    return fp8_dot


def install() -> None:
    """Wraps the Pallas Triton lowering's tt.dot builder (once)."""
    dialect = lowering.tt_dialect
    if not getattr(dialect.dot, "wraps_fp8_accumulation", False):
        dialect.dot = _with_fp8_accumulation(dialect.dot)
