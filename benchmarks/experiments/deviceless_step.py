"""The engine's step compiled for an H200 on a machine without a GPU (XLA's deviceless
compilation), and what it launches: every kernel of the optimised program, its kind and the
bytes it reads and writes, so that kernel counts and the small kernels' traffic can be worked
on between GPU sessions. No timing and no autotuning (XLA picks its GEMMs by heuristics, where
the GPU's autotuner may choose other kernels); the Pallas kernels compile through Triton as on
the GPU.

Needs jax's CUDA plugin in the environment (it compiles without a driver):
    python3.12 -m venv /tmp/gv
    /tmp/gv/bin/pip install -e . "jax-cuda13-plugin[with-cuda]==0.11.2"
    JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 /tmp/gv/bin/python \
        benchmarks/experiments/deviceless_step.py --tokens 512 --quantization fp8 --out DIR

Bytes are each kernel's operands and results, an operand that the kernel only slices (a
layer's row of a stack, a page gather) counted as the slice, an in-place update as the
update (a Pallas kernel's, whose update is not in its shapes, as none: its other operands'
reads bound it): a floor on its traffic, not a measurement. A Pallas kernel given a whole
layer stack (params["layer_stacks"], read in place at its layer) counts one row of it.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import math
import os
import re
import sys
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from quant_gpu import random_int4_weight  # noqa: E402  (benchmarks/)

H200_TARGET = """
gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132
  fpus_per_core: 128 block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
  block_dim_limit_z: 65535 memory_bandwidth: 4800000000000 l2_cache_size: 52428800
  clock_rate_ghz: 1.98 device_memory_size: 150000000000 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 } registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
runtime_version: { major: 13 minor: 0 patch: 0 }
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 10 }
device_description_str: "NVIDIA H200"
"""
COPY_BYTES_PER_S = 4.2e12  # the H200's measured copy bandwidth (docs/benchmarks.md)
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "s16": 2, "u16": 2, "bf16": 2,
                "f16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_SHAPE = re.compile(r"\b(pred|[suf]\d+|bf16|f8e4m3fn)\[([\d,]*)\]")
_INSTR = re.compile(r"^\s*(ROOT )?%(\S+) = (.+?) (\w[\w-]*)\((.*?)\)(, .*)?$")
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
         "partition-id", "replica-id"}  # no launch (calls, loops, conditionals are walked)


def shape_bytes(text: str) -> int:
    return sum(_DTYPE_BYTES[dt] * math.prod(int(d) for d in dims.split(",") if d)
               for dt, dims in _SHAPE.findall(text))


def parse_computations(hlo: str) -> tuple[dict, str]:
    """name -> list of (name, result shape text, opcode, operand names, attributes); and the
    entry computation's name."""
    comps, entry, current = {}, None, None
    for line in hlo.splitlines():
        head = re.match(r"^(ENTRY )?%(\S+) \(.*\) -> .* \{$", line)
        if head:
            current = head.group(2)
            comps[current] = []
            entry = current if head.group(1) else entry
            continue
        m = _INSTR.match(line) if current else None
        if m:
            operands = re.findall(r"%([\w.\-]+)", m.group(5))
            attrs = m.group(6) or ""
            if m.group(4) == "parameter":  # its index, for _param_traffic
                attrs = f"parameter({m.group(5)}){attrs}"
            comps[current].append((m.group(2), m.group(3), m.group(4), operands, attrs))
    return comps, entry


def _param_traffic(comp: list, index: int) -> int | None:
    """Bytes a fused computation reads of its parameter `index` when it only slices or gathers
    from it (through bitcasts) or updates it in place (0: the update counts as written); None
    when it reads it whole."""
    param = next((n for n, _, op, _, attrs in comp if op == "parameter"
                  and f"parameter({index})" in attrs), None)
    names, sliced = {param}, 0
    for name, shape, op, operands, _ in comp:
        if not names.intersection(operands):
            continue
        if op == "bitcast":
            names.add(name)
        elif op in ("dynamic-slice", "slice", "gather"):
            sliced += shape_bytes(shape)
        elif op not in ("dynamic-update-slice", "scatter") or operands[0] not in names:
            return None
    return sliced if param is not None else None


def _in_place_update(comp: list, shapes: dict) -> int | None:
    """The bytes a fused in-place update (its root a dynamic-update-slice or scatter) writes."""
    root = comp[-1] if comp else None
    if root is None or root[2] not in ("dynamic-update-slice", "scatter"):
        return None
    local = {n: s for n, s, *_ in comp}
    update = root[3][1] if root[2] == "dynamic-update-slice" else root[3][-1]
    return shape_bytes(local.get(update, shapes.get(update, "")))


def _stack_row(name: str, shape: str) -> int:
    """The bytes a kernel reads of operand `name`: one layer's row of a layer stack (an entry
    parameter of params["layer_stacks"], [L, ...]), else the whole array."""
    found = _SHAPE.search(shape)
    if "layer_stacks" not in name or not found or not found.group(2):
        return shape_bytes(shape)
    return shape_bytes(shape) // int(found.group(2).split(",")[0])


def _aliased(attrs: str) -> dict[int, int]:
    """A custom call's outputs updated in place: output index -> its operand's."""
    found = re.search(r"output_to_operand_aliasing=\{(.*?)\}(?:,|$)", attrs)
    pairs = re.findall(r"\{(\d*)\}: \((\d+),", found.group(1)) if found else []
    return {int(out or 0): int(operand) for out, operand in pairs}


def _label(op: str, instr: str, attrs: str) -> str:
    """A kernel's name for the tally: a Pallas kernel's function, a fusion's kind of root and
    the jax op it came from."""
    op_name = re.search(r'op_name="([^"]+)"', attrs)
    source = op_name.group(1) if op_name else ""
    if op == "custom-call":
        called = re.findall(r"(\w+)/pallas_call", source) or re.findall(r"jit\((\w+)\)", source)
        return f"pallas:{called[-1]}" if called else op
    tail = source.rsplit("/", 1)[-1]
    return f"{re.sub(r'[.\d]+$', '', instr)}:{tail}"


def kernels(comps: dict, entry: str) -> list[dict]:
    """The launches of the entry computation, calls and command buffers expanded (a while
    loop's body counted once). Attention's bytes are its queries and outputs only: the KV it
    reads depends on the batch's context lengths."""
    shapes = {n: s for comp in comps.values() for n, s, *_ in comp}
    bitcast_of = {n: ops[0] for comp in comps.values() for n, _, op, ops, _ in comp
                  if op == "bitcast" and ops}

    def source(name: str) -> str:  # the array a chain of bitcasts views
        while name in bitcast_of:
            name = bitcast_of[name]
        return name

    out = []

    def walk(name: str) -> None:
        for instr, shape, op, operands, attrs in comps[name]:
            called = re.findall(r"(?:calls|to_apply|body|branch_computations)=\{?%([\w.\-]+)",
                                attrs)
            if op in ("call", "while", "conditional"):
                for c in called:
                    walk(c)
                continue
            if op in _FREE:
                continue
            label = _label(op, instr, attrs)
            fused = comps.get(called[0]) if op == "fusion" and called else None
            sizes = [_stack_row(source(o), shapes.get(o, "")) if fused is None else
                     shape_bytes(shapes.get(o, "")) for o in operands]
            if label == "pallas:ragged_paged_attention":
                sizes = [b for b in sizes if b < shape_bytes(shape) * 4]
            # a cache updated in place (an aliased operand larger than the kernel's other
            # operands together): its slots are a share of what the kernel reads
            aliased = _aliased(attrs) if op == "custom-call" else {}
            rest = sum(b for i, b in enumerate(sizes) if i not in aliased.values())
            aliased = {o: i for o, i in aliased.items() if i < len(sizes) and sizes[i] > rest}
            if aliased:
                sizes = [0 if i in aliased.values() else b for i, b in enumerate(sizes)]
            read = sum(b if fused is None or _param_traffic(fused, i) is None
                       else _param_traffic(fused, i) for i, b in enumerate(sizes))
            written = (_in_place_update(fused, shapes) if fused else None)
            if aliased:
                outputs = _SHAPE.findall(shape)
                written = sum(shape_bytes(f"{t}[{d}]") for i, (t, d) in enumerate(outputs)
                              if i not in aliased)
            written = shape_bytes(shape) if written is None else written
            out.append(dict(name=instr, label=label, bytes=read + written))

    walk(entry)
    return out


def abstract_8b_params(model: str, quantization: str | None, sharding):
    """The engine's single-device params for a preset, as ShapeDtypeStructs: fused, quantised
    at load (fp8), the layers' small arrays stacked."""
    from jaxllm.loader.dummy import dummy_params
    from jaxllm.models import ModelArgs, fuse_params
    from jaxllm.models.layer_stacks import stack_layers
    from jaxllm.models.presets import PRESETS
    from jaxllm.models.quant import QUANTIZED_NAMES, Fp8BlockWeight, quantize_fp8

    args = ModelArgs.from_hf_config(PRESETS[model])

    def build():
        params = fuse_params(dummy_params(args, jnp.bfloat16), args.num_kv_heads)
        int4 = lambda w: random_int4_weight(jax.random.key(0), w)  # noqa: E731

        def fp8_block(w):  # a 128 x 128 block-wise checkpoint's weight, as loaded
            values = quantize_fp8(w).values
            groups = -(-w.shape[0] // 128)
            return Fp8BlockWeight(values, jnp.ones((*values.shape[:-1], groups), jnp.float32))

        quantize = {"fp8": quantize_fp8, "fp8-block": fp8_block, "int4": int4,
                    None: None}[quantization]
        if quantize is not None:
            params["layers"] = [{k: quantize(v) if k in QUANTIZED_NAMES else v
                                 for k, v in layer.items()} for layer in params["layers"]]
        return stack_layers(params, free_inputs=False)

    shapes = jax.eval_shape(build)
    return args, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                             sharding=sharding), shapes)


@contextlib.contextmanager
def as_gpu():
    """Traces as on an H200: the product's `jax.default_backend() == "gpu"` paths and the
    Pallas lowering's abstract device."""
    from jax.sharding import AbstractDevice, AbstractMesh

    from pallas_kernels import ragged_paged_attention

    mesh = AbstractMesh((), (), abstract_device=AbstractDevice(
        device_kind="NVIDIA H200", platform="gpu", num_cores=132))
    with mock.patch.object(jax, "default_backend", lambda: "gpu"), \
            mock.patch.object(ragged_paged_attention, "_is_hopper", lambda: True), \
            jax.sharding.use_abstract_mesh(mesh):
        yield


def compile_step(a) -> str:
    from jax.experimental.topologies import get_topology_desc

    from jaxllm.models import forward
    from jaxllm.models.attention import attention_backend
    from jaxllm.models.quant import has_gemv_weights
    from jaxllm.sample.sampler import SamplerStages
    from jaxllm.worker.kv_cache import cache_dtype, cache_shape
    from jaxllm.worker.model_runner import ModelRunner
    from jaxllm.worker.packing import pack

    device = get_topology_desc("h200", "cuda", target_config=H200_TARGET,
                               topology="1x1x1").devices[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    abstract = lambda tree: jax.tree.map(  # noqa: E731
        lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding), tree)
    with as_gpu():
        args, params = abstract_8b_params(a.model, a.quantization, sharding)
        kv_shape = cache_shape(a.num_blocks, a.block_size, args.num_kv_heads, args.head_dim)
        kv_dtype = cache_dtype(a.kv_cache_dtype, jnp.bfloat16)
        caches = [(jax.ShapeDtypeStruct(kv_shape, kv_dtype, sharding=sharding),) * 2
                  for _ in range(args.num_layers)]
        attn, write_kv = attention_backend("pallas")
        model_fn = lambda p, c, b, **kw: forward(p, c, b, args=args, attn=attn,  # noqa: E731
                                                 write_kv=write_kv, **kw)
        runner = ModelRunner(model_fn, params, caches, vocab_size=args.vocab_size,
                             block_size=a.block_size, max_model_len=a.max_model_len,
                             max_num_seqs=a.max_num_seqs,
                             max_num_batched_tokens=max(a.tokens, a.max_num_seqs, 16),
                             lean_steps=True, one_token_bucket=has_gemv_weights(params))
        runner.state = abstract(runner.state)
        packed, layout = pack(runner._padding_inputs(a.tokens))
        lowered = runner._lower(abstract(packed), layout, SamplerStages[a.stages.upper()])
    return lowered.compile().as_text()


def summarize(found: list[dict], num_layers: int, top: int) -> dict:
    by_kind = collections.defaultdict(lambda: [0, 0])
    for k in found:
        key = k["label"]
        by_kind[key][0] += 1
        by_kind[key][1] += k["bytes"]
    total = sum(k["bytes"] for k in found)
    rows = sorted(by_kind.items(), key=lambda kv: -kv[1][1])
    return {
        "kernels": len(found), "kernels_per_layer": round(len(found) / num_layers, 1),
        "bytes": total, "copy_floor_us": round(total / COPY_BYTES_PER_S * 1e6, 1),
        "by_kind (label, launches, MB, us at copy bandwidth)": [
            (name, count, round(b / 1e6, 2), round(b / COPY_BYTES_PER_S * 1e6, 1))
            for name, (count, b) in rows[:top]],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--tokens", type=int, default=512, help="the bucket's token count")
    parser.add_argument("--max-num-seqs", type=int, default=512)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--num-blocks", type=int, default=4096)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--quantization", choices=["fp8", "fp8-block", "int4"])
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--stages", default="greedy", choices=["greedy", "plain", "all"])
    parser.add_argument("--top", type=int, default=40)
    a = parser.parse_args()
    os.makedirs(a.out, exist_ok=True)
    hlo = compile_step(a)
    name = f"step_t{a.tokens}_{a.quantization or 'bf16'}_kv{a.kv_cache_dtype}"
    with open(os.path.join(a.out, name + ".hlo.txt"), "w") as f:
        f.write(hlo)
    comps, entry = parse_computations(hlo)
    found = kernels(comps, entry)
    from jaxllm.models import ModelArgs
    from jaxllm.models.presets import PRESETS
    arguments = sum(op == "parameter" for _, _, op, _, _ in comps[entry])
    summary = {"config": vars(a), "argument_buffers": arguments, **summarize(
        found, ModelArgs.from_hf_config(PRESETS[a.model]).num_layers, a.top)}
    with open(os.path.join(a.out, name + ".json"), "w") as f:
        json.dump({**summary, "kernel_list": found}, f, indent=1)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
