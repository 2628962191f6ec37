"""Does the engine start and generate on every supported configuration? One device call.

    python benchmarks/gpu_smoke.py --out DIR            # the GPU matrix (TP=2 cases when 2 GPUs)
    python benchmarks/gpu_smoke.py --cpu --out DIR      # a reduced matrix on the CPU

Each case starts an engine (dummy weights, warm-up included: start-up is what is checked) in its
own process, so a crash fails that case only, and generates a few greedy tokens with logprobs.
A case passes when it starts, its logprobs are finite, and its tokens equal those of every
other case of the same model, dtype, max_model_len and block size (other backends, batch
sizes, TP), unless they part at a near tie (the two best logprobs within TIE of each other).
Pooling cases (a small BERT) embed the prompts instead: finite, and within COSINE of each
other's embeddings.

The matrix is a covering design, not the product: every backend with a small and the default
max_num_seqs; every max_num_seqs (1/2/8/256), max_model_len (777/2048/8192), block size
(16/32/64) and dtype (bf16/fp16/fp32) at least once, each beside two backends to compare; the
8B shape at the sizes reported to crash; TP=2, DP=2 and PP=2 (with two GPUs). Small cases run
side by side, each engine bounded by its gpu_memory_utilization. Writes DIR/gpu_smoke.json and
DIR/gpu_smoke.md; prints a row per finished case.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Logprob gap under which two greedy paths may part, by dtype: two kernels (Triton and Mosaic
# prefill, say) round differently, and random weights make near ties common. The kernels'
# numerics are checked against fp32 references by pallas_kernels.bench; this checks start-up.
TIE = {"float32": 0.01, "float16": 0.1, "bfloat16": 0.3}
# Least cosine between two cases' embeddings of a prompt (attention backends round differently).
COSINE = {"float32": 0.99999, "float16": 0.999, "bfloat16": 0.99}
# A BERT shape whose hidden size (96) is no power of two and whose head size (24) is cuDNN's
# smallest kind: the LayerNorm kernel's masked lanes and the fused attention's edge.
POOLING_MODEL = dict(architectures=["BertModel"], model_type="bert", vocab_size=30522,
                     hidden_size=96, intermediate_size=192, num_hidden_layers=2,
                     num_attention_heads=4, max_position_embeddings=512, type_vocab_size=2,
                     layer_norm_eps=1e-12, hidden_act="gelu", pad_token_id=0)
# No dummy weights exist for a GPTQ checkpoint: this case model is a tiny random Llama (hidden
# 128, seeded) written as a round-to-nearest GPTQ checkpoint (group 32), once per run of the
# matrix (write_checkpoints), for every case that runs it.
GPTQ_MODEL = "llama-tiny-gptq"
# The same tiny Llama as a compressed-tensors FP8 checkpoint with static per-layer KV scales.
FP8_KV_MODEL = "llama-tiny-fp8-kv-scales"
# ... and as a block-wise FP8 checkpoint (128 x 128 blocks: the block-scaled kernel's groups).
FP8_BLOCK_MODEL = "llama-tiny-fp8-block"
# ... and as a static FP8 checkpoint (per-tensor activation scales, calibrated by HF's model).
FP8_STATIC_MODEL = "llama-tiny-fp8-static"
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}


@dataclass(frozen=True)
class Case:
    model: str
    dtype: str
    max_model_len: int
    block_size: int
    max_num_seqs: int
    backend: str
    tp: int = 1
    dp: int = 1
    pp: int = 1
    utilization: float = 0.1
    max_num_batched_tokens: int | None = 512
    enforce_eager: bool = False  # the CPU matrix checks this script, not the warm-up
    expect_error: bool = False
    kv_cache_dtype: str = "auto"
    quantization: str | None = None
    speculative: bool = False  # n-gram speculation: its greedy tokens equal the plain ones'
    eagle: bool = False  # EAGLE speculation with a random head: greedy tokens as plain
    lora: bool = False  # the second prompt runs with a random rank-16 adapter (multi-LoRA)
    draft: bool = False  # draft-model speculation, the model its own draft: tokens as plain
    pooling: bool = False  # a BERT encoder (POOLING_MODEL, dummy weights) embeds the prompts
    alone: bool = False  # runs with no other case on the device

    @property
    def name(self) -> str:
        features = "".join([f" kv-{self.kv_cache_dtype}" * (self.kv_cache_dtype != "auto"),
                            f" q-{self.quantization}" * (self.quantization is not None),
                            " ngram" * self.speculative, " eagle" * self.eagle,
                            " draft" * self.draft,
                            " lora" * self.lora, " embed" * self.pooling])
        layout = f"tp{self.tp}" + f" dp{self.dp}" * (self.dp > 1) + f" pp{self.pp}" * (self.pp > 1)
        return (f"{self.model} {self.dtype} len{self.max_model_len} bs{self.block_size} "
                f"seqs{self.max_num_seqs} {self.backend} {layout}{features}")

    @property
    def num_gpus(self) -> int:
        return self.tp * self.dp * self.pp

    @property
    def exclusive(self) -> bool:
        """Whether the case must have the device(s) to itself: multi-GPU cases, and those
        marked alone."""
        return self.alone or self.num_gpus > 1

    @property
    def group(self) -> tuple:
        """Cases whose greedy tokens must agree."""
        return (self.model, self.dtype, self.max_model_len, self.block_size,
                self.kv_cache_dtype, self.quantization, self.lora, self.pooling)


def gpu_matrix(num_gpus: int) -> list[Case]:
    tiny = "llama-tiny"
    cases = [Case(tiny, "bfloat16", 2048, 16, seqs, backend)
             for seqs in (1, 256) for backend in ("pallas", "triton", "mosaic", "xla")]
    cases += [Case(tiny, "float16", 777, 32, 2, backend) for backend in ("pallas", "mosaic", "xla")]
    cases += [Case(tiny, "float32", 8192, 64, 8, backend) for backend in ("pallas", "triton", "xla")]
    cases += [Case(tiny, "bfloat16", 8192, 64, 8, backend) for backend in ("mosaic", "triton")]
    # the features that change the step: FP8 pages (Triton reads them), FP8 weights, speculation
    cases += [Case(tiny, "bfloat16", 2048, 16, 8, backend, kv_cache_dtype="fp8")
              for backend in ("pallas", "triton", "xla")]
    # FP8 pages at the small sizes (split-KV decode buckets) and with float16 q
    cases += [Case(tiny, dtype, length, block, seqs, backend, kv_cache_dtype="fp8")
              for dtype, length, block, seqs in (("bfloat16", 2048, 16, 1),
                                                 ("float16", 777, 32, 2))
              for backend in ("pallas", "xla")]
    cases += [Case(tiny, "bfloat16", 2048, 16, 8, backend, quantization="fp8")
              for backend in ("pallas", "xla")]
    # FP8 weights (the SwiGLU quantisation kernel) at one and 256 sequences, and with float16
    cases += [Case(tiny, dtype, length, block, seqs, backend, quantization="fp8")
              for dtype, length, block, seqs in (("bfloat16", 2048, 16, 1),
                                                 ("bfloat16", 2048, 16, 256),
                                                 ("float16", 777, 32, 2))
              for backend in ("pallas", "xla")]
    # int4 weights (a GPTQ checkpoint): the one-token GEMV at one sequence, the GEMM past it
    cases += [Case(GPTQ_MODEL, dtype, length, block, seqs, backend, quantization="gptq")
              for dtype, length, block, seqs in (("bfloat16", 2048, 16, 1),
                                                 ("bfloat16", 2048, 16, 8),
                                                 ("float16", 777, 32, 2))
              for backend in ("pallas", "xla")]
    # an FP8 checkpoint's KV scales, applied around the attention kernels
    cases += [Case(FP8_KV_MODEL, "bfloat16", 2048, 16, seqs, backend, kv_cache_dtype="fp8",
                   quantization="compressed-tensors")
              for seqs in (1, 8) for backend in ("pallas", "xla")]
    # a block-wise FP8 checkpoint: the block-scaled kernel, decode (K split) and prefill tiles
    cases += [Case(FP8_BLOCK_MODEL, dtype, length, block, seqs, backend, quantization="fp8")
              for dtype, length, block, seqs in (("bfloat16", 2048, 16, 1),
                                                 ("bfloat16", 2048, 16, 8),
                                                 ("float16", 777, 32, 2))
              for backend in ("pallas", "xla")]
    # a static FP8 checkpoint: the quantisation kernels at its scales (one SwiGLU pass)
    cases += [Case(FP8_STATIC_MODEL, dtype, length, block, seqs, backend, quantization="fp8")
              for dtype, length, block, seqs in (("bfloat16", 2048, 16, 1),
                                                 ("bfloat16", 2048, 16, 256),
                                                 ("float16", 777, 32, 2))
              for backend in ("pallas", "xla")]
    cases += [Case(tiny, "bfloat16", 2048, 16, seqs, "pallas", speculative=True)
              for seqs in (1, 256)]
    cases += [Case(tiny, "bfloat16", 2048, 16, seqs, "pallas", eagle=True) for seqs in (1, 8)]
    cases += [Case(tiny, "bfloat16", 2048, 16, seqs, "pallas", draft=True) for seqs in (1, 8)]
    # the LoRA kernels (pallas) against their references (xla)
    cases += [Case(tiny, "bfloat16", 2048, 16, 8, backend, lora=True)
              for backend in ("pallas", "xla")]
    # pooling: cuDNN's attention (auto) against XLA's, the LayerNorm kernel in both
    cases += [Case("bert-tiny", "float16", 512, 16, seqs, backend, pooling=True)
              for seqs in (1, 256) for backend in ("auto", "xla")]
    cases += [Case("bert-tiny", "float32", 64, 16, 8, backend, pooling=True)
              for backend in ("auto", "xla")]
    # the 8B shape: the sizes reported to crash in warm-up, and the default
    big = dict(model="llama-3.1-8b", dtype="bfloat16", max_model_len=2048, block_size=16,
               utilization=0.3, max_num_batched_tokens=None)
    # an MoE with FP8 experts (the grouped matmul's FP8 path), alone: beside seven small
    # engines its step once failed to allocate within its share (their CUDA contexts and
    # autotuning buffers lie outside their pools); alone it starts (docs/lab, session 22). Its
    # pool must hold the bf16 weights it quantises at load (model_setup.check_fp8_load_fits).
    cases += [Case("qwen3-30b-a3b", "bfloat16", 2048, 16, 8, "pallas", utilization=0.9,
                   max_num_batched_tokens=None, quantization="fp8", alone=True)]
    cases += [Case(max_num_seqs=8, backend="pallas", **big),
              Case(max_num_seqs=2, backend="pallas", **big),
              Case(max_num_seqs=2, backend="triton", **big),
              Case(max_num_seqs=256, backend="pallas", **big)]
    if num_gpus >= 2:
        cases += [Case(tiny, "bfloat16", 2048, 16, seqs, "pallas", tp=2) for seqs in (8, 256)]
        cases += [Case(tiny, "bfloat16", 2048, 16, 8, "pallas", dp=2),
                  Case(tiny, "bfloat16", 2048, 16, 8, "pallas", pp=2)]
    return cases


def cpu_matrix() -> list[Case]:
    small = dict(model="llama-tiny", max_num_batched_tokens=64, enforce_eager=True)
    return [Case(dtype="float32", max_model_len=777, block_size=16, max_num_seqs=1,
                 backend="xla", **small),
            Case(dtype="float32", max_model_len=777, block_size=16, max_num_seqs=8,
                 backend="xla", **small),
            Case(dtype="float32", max_model_len=777, block_size=16, max_num_seqs=8,
                 backend="xla", speculative=True, **small),
            Case(dtype="float32", max_model_len=777, block_size=16, max_num_seqs=8,
                 backend="xla", lora=True, **small),
            Case(dtype="float32", max_model_len=777, block_size=16, max_num_seqs=8,
                 backend="xla", eagle=True, **small),
            Case(dtype="float32", max_model_len=777, block_size=16, max_num_seqs=8,
                 backend="xla", draft=True, **small),
            Case(dtype="float32", max_model_len=777, block_size=16, max_num_seqs=1,
                 backend="xla", quantization="gptq", **{**small, "model": GPTQ_MODEL}),
            Case(dtype="float32", max_model_len=777, block_size=16, max_num_seqs=1,
                 backend="xla", kv_cache_dtype="fp8", quantization="compressed-tensors",
                 **{**small, "model": FP8_KV_MODEL}),
            Case(dtype="float32", max_model_len=777, block_size=16, max_num_seqs=1,
                 backend="xla", quantization="fp8", **{**small, "model": FP8_BLOCK_MODEL}),
            Case(dtype="float32", max_model_len=777, block_size=16, max_num_seqs=8,
                 backend="xla", quantization="fp8", **{**small, "model": FP8_STATIC_MODEL}),
            Case(model="bert-tiny", dtype="float32", max_model_len=64, block_size=16,
                 max_num_seqs=8, backend="xla", pooling=True, enforce_eager=True),
            Case(model="bert-tiny", dtype="float32", max_model_len=64, block_size=16,
                 max_num_seqs=1, backend="auto", pooling=True, enforce_eager=True),
            # the Mosaic kernel has no CPU lowering: a case that fails must not end the matrix
            Case(dtype="bfloat16", max_model_len=777, block_size=16, max_num_seqs=2,
                 backend="mosaic", expect_error=True, **small)]


def prompts_for(case: Case) -> list[list[int]]:
    """Three prompts, the last near max_model_len, ids clear of the special ones."""
    lengths = (5, 60, min(400, case.max_model_len - 16))
    written = (GPTQ_MODEL, FP8_KV_MODEL, FP8_BLOCK_MODEL, FP8_STATIC_MODEL)
    span = 360 if case.model in written else 4000  # the tiny tokenizer's ids
    return [[3 + (7 * i + 11 * n) % span for i in range(n)] for n in lengths]


# -- one case, in its own process ------------------------------------------------------------
def run_case(case: Case) -> dict:
    from jaxllm import LLM, SamplingParams

    if case.pooling:
        return _run_pooling_case(case)
    start = time.perf_counter()
    lora_kwargs, adapter = _lora(case)
    written = json.loads(os.environ.get(CHECKPOINTS, "{}"))
    model, load_format = ((written[case.model], "auto") if case.model in WRITERS
                          else (case.model, "dummy"))
    llm = LLM(model=model, load_format=load_format, dtype=case.dtype,
              max_model_len=case.max_model_len, block_size=case.block_size,
              max_num_seqs=case.max_num_seqs, max_num_batched_tokens=case.max_num_batched_tokens,
              attention_backend=case.backend, tensor_parallel_size=case.tp,
              data_parallel_size=case.dp, pipeline_parallel_size=case.pp,
              gpu_memory_utilization=case.utilization, enforce_eager=case.enforce_eager,
              kv_cache_dtype=case.kv_cache_dtype, quantization=case.quantization,
              speculative_config=_speculative(case), **lora_kwargs)
    started = time.perf_counter() - start
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=2, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts_for(case)], params,
                           use_tqdm=False, lora_request=adapter and [None, adapter, None])
    tokens, tops = [], []
    for out in outputs:
        completion = out.outputs[0]
        tokens.append(list(completion.token_ids))
        tops.append([sorted((lp.logprob for lp in step.values()), reverse=True)
                     for step in completion.logprobs])
    return {"start_s": round(started, 1), "generate_s": round(time.perf_counter() - start
                                                              - started, 1),
            "tokens": tokens, "top_logprobs": tops}


def _conftest():
    """The tests' conftest: the tiny models' configs and checkpoint writers."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import conftest
    return conftest


def _tiny_llama_dir(out_dir: str) -> str:
    tests = _conftest()
    config = dict(tests.TINY_CONFIGS["llama"], hidden_size=128, intermediate_size=256,
                  max_position_embeddings=8192)  # prompts_for's lengths
    return tests.save_random_checkpoint(config, out_dir, tests.build_tiny_tokenizer())


def _tiny_gptq_dir(llama: str, out_dir: str) -> str:
    from jaxllm.loader.gptq_writer import write_rtn_gptq
    return write_rtn_gptq(llama, out_dir, group_size=32)


def _tiny_fp8_kv_dir(llama: str, out_dir: str) -> str:
    tests = _conftest()
    scales = {layer: (0.5 + layer, 2.0 - 0.5 * layer)
              for layer in range(tests.TINY_CONFIGS["llama"]["num_hidden_layers"])}
    return tests.write_fp8_kv_scaled(llama, out_dir, scales)


def _tiny_fp8_block_dir(llama: str, out_dir: str) -> str:
    from jaxllm.loader.fp8_writer import write_fp8
    return write_fp8(llama, out_dir, {"quant_method": "fp8", "activation_scheme": "dynamic",
                                      "weight_block_size": [128, 128]})


def _tiny_fp8_static_dir(llama: str, out_dir: str) -> str:
    from jaxllm.loader.fp8_writer import calibrated_input_scales, write_fp8
    calibration = [[3 + (13 * i + 5 * n) % 360 for i in range(n)] for n in (17, 90)]
    return write_fp8(llama, out_dir, {"quant_method": "fp8", "activation_scheme": "static"},
                     calibrated_input_scales(llama, calibration))


# the written models' writers: (the tiny Llama's directory, out_dir) -> out_dir
WRITERS = {GPTQ_MODEL: _tiny_gptq_dir, FP8_KV_MODEL: _tiny_fp8_kv_dir,
           FP8_BLOCK_MODEL: _tiny_fp8_block_dir, FP8_STATIC_MODEL: _tiny_fp8_static_dir}
CHECKPOINTS = "GPU_SMOKE_CHECKPOINTS"  # the cases' environment: {written model: its directory}


def write_checkpoints(models: list[str], out_dir: str) -> dict[str, str]:
    """The written models' checkpoints under out_dir/checkpoints, the tiny Llama written once
    for them all: {model: directory}."""
    root = os.path.join(out_dir, "checkpoints")
    llama = _tiny_llama_dir(os.path.join(root, "llama-tiny"))
    return {model: WRITERS[model](llama, os.path.join(root, model)) for model in models}


def _write_checkpoints_apart(cases: list[Case], out_dir: str) -> dict[str, str]:
    """write_checkpoints for the cases' written models, in a CPU process of its own (jax in this
    one would take the GPU's memory from the cases)."""
    models = sorted({case.model for case in cases} & WRITERS.keys())
    if not models:
        return {}
    out = subprocess.run([sys.executable, __file__, "--write-checkpoints", json.dumps(models),
                          "--out", out_dir], cwd=ROOT, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu"))
    if out.returncode != 0:
        raise SystemExit(f"writing the checkpoints of {models} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _run_pooling_case(case: Case) -> dict:
    import tempfile

    from jaxllm import LLM

    model = tempfile.mkdtemp(prefix="gpu_smoke_bert")
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump(POOLING_MODEL, f)
    start = time.perf_counter()
    llm = LLM(model=model, load_format="dummy", dtype=case.dtype,
              max_model_len=case.max_model_len, max_num_seqs=case.max_num_seqs,
              attention_backend=case.backend, gpu_memory_utilization=case.utilization,
              enforce_eager=case.enforce_eager)
    started = time.perf_counter() - start
    outputs = llm.embed(prompts_for(case), use_tqdm=False)
    return {"start_s": round(started, 1),
            "generate_s": round(time.perf_counter() - start - started, 1),
            "embeddings": [list(map(float, o.outputs.embedding)) for o in outputs]}


def _speculative(case: Case) -> dict | None:
    """n-gram; the case's model as its own draft model; or EAGLE with a random head of the
    case's model saved for this process."""
    if case.speculative:
        return NGRAM
    if case.draft:
        return {"method": "draft_model", "model": case.model, "num_speculative_tokens": 3}
    if not case.eagle:
        return None
    import tempfile

    from jaxllm.loader.loader import read_hf_config
    from spec_decode_gpu import save_eagle_head

    head = save_eagle_head(tempfile.mkdtemp(prefix="gpu_smoke_eagle"),
                           read_hf_config(case.model, "dummy"), identity=False)
    return {"method": "eagle", "model": head, "num_speculative_tokens": 3}


def _lora(case: Case):
    """With case.lora: the engine's LoRA flags and a random adapter saved for this process."""
    if not case.lora:
        return {}, None
    import tempfile

    from jaxllm import LoRARequest
    from jaxllm.bench import roofline
    from lora_gpu import save_dummy_adapter

    path = save_dummy_adapter(tempfile.mkdtemp(prefix="gpu_smoke_lora"),
                              roofline.model_args_of(case.model, "dummy"), 16, 0)
    return dict(enable_lora=True, max_loras=2, max_lora_rank=16), LoRARequest("smoke", 1, path)


# -- the matrix ---------------------------------------------------------------------------------
def _launch(case: Case, out_dir: str, index: int) -> tuple[subprocess.Popen, float]:
    # the engine sizes jax's pool from its gpu_memory_utilization; set here too, so that cases
    # side by side fit even where the engine does not
    env = dict(os.environ, PYTHONPATH=ROOT, XLA_PYTHON_CLIENT_MEM_FRACTION=str(case.utilization))
    log = open(os.path.join(out_dir, f"case_{index:02d}.log"), "w")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, __file__, "--case", json.dumps(asdict(case))],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
    return proc, time.perf_counter()


def _finish(case: Case, proc: subprocess.Popen, began: float, out_dir: str, index: int) -> dict:
    stdout = proc.stdout.read()
    row = {"case": case.name, **asdict(case), "rc": proc.returncode,
           "wall_s": round(time.perf_counter() - began, 1)}
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode == 0 and lines:
        row.update(json.loads(lines[-1][7:]))
    else:
        with open(os.path.join(out_dir, f"case_{index:02d}.log")) as f:
            row["error"] = _last_error(f.read()) or f"rc {proc.returncode}"
    return row


def _last_error(log: str) -> str | None:
    """The exception line of a traceback in the case's log (else its last line)."""
    lines = [line for line in log.strip().splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"^[\w.]*(Error|Exception)\b.*:", line)]
    return (errors or lines or [None])[-1]


def run_matrix(cases: list[Case], out_dir: str, jobs: int, timeout_s: float) -> list[dict]:
    """Runs cases side by side while their memory shares fit one device (exclusive cases
    alone)."""
    os.makedirs(out_dir, exist_ok=True)
    pending = list(enumerate(cases))
    running: dict[int, tuple] = {}
    rows = []
    while pending or running:
        share = sum(case.utilization for case, *_ in running.values())
        alone = any(case.exclusive for case, *_ in running.values())
        for item in list(pending):
            index, case = item
            fits = share + case.utilization <= 0.9 and len(running) < jobs and not alone
            if fits and (not case.exclusive or not running):
                running[index] = (case, *_launch(case, out_dir, index))
                pending.remove(item)
                share += case.utilization
                alone = case.exclusive
        time.sleep(0.5)
        for index, (case, proc, began) in list(running.items()):
            if proc.poll() is None and time.perf_counter() - began > timeout_s:
                proc.kill()
                proc.wait()
            if proc.poll() is not None:
                del running[index]
                rows.append(_finish(case, proc, began, out_dir, index))
                _print_row(rows[-1])
    return rows


def judge(rows: list[dict]) -> None:
    """Sets each row's verdict: started, finite logprobs, and greedy agreement in its group."""
    by_group: dict[tuple, list[dict]] = {}
    for row in rows:
        by_group.setdefault(_group(row), []).append(row)
    for row in rows:
        if "embeddings" in row:
            row["verdict"] = _judge_embeddings(row, by_group[_group(row)])
            continue
        if "tokens" not in row:
            row["verdict"] = "expected error" if row["expect_error"] else "FAIL: " + row["error"]
            continue
        if row["expect_error"]:
            row["verdict"] = "FAIL: started, but an error was expected"
            continue
        finite = all(math.isfinite(x) for seq in row["top_logprobs"] for step in seq for x in step)
        peers = [p for p in by_group[_group(row)] if "tokens" in p and p is not row]
        parted = [p["case"] for p in peers if not _agree(row, p)]
        row["verdict"] = ("FAIL: non-finite logprobs" if not finite
                          else f"FAIL: tokens differ from {parted}" if parted
                          else f"ok ({len(peers)} peers agree)")


def _judge_embeddings(row: dict, group: list[dict]) -> str:
    from jaxllm.engine.pooling_inputs import cosine

    if row["expect_error"]:
        return "FAIL: started, but an error was expected"
    ours = np.array(row["embeddings"])
    if not np.isfinite(ours).all():
        return "FAIL: non-finite embeddings"
    peers = [p for p in group if "embeddings" in p and p is not row]
    parted = [p["case"] for p in peers if min(map(cosine, ours, np.array(p["embeddings"])))
              < COSINE[row["dtype"]]]
    return f"FAIL: embeddings differ from {parted}" if parted else f"ok ({len(peers)} peers agree)"


def _group(row: dict) -> tuple:
    return Case(**{k: row[k] for k in Case.__dataclass_fields__}).group


def _agree(a: dict, b: dict) -> bool:
    """Equal greedy tokens, or parted first where either saw a near tie."""
    tie = TIE[a["dtype"]]
    for seq_a, seq_b, tops_a, tops_b in zip(a["tokens"], b["tokens"], a["top_logprobs"],
                                            b["top_logprobs"]):
        for step, (x, y) in enumerate(zip(seq_a, seq_b)):
            if x != y:
                if not any(len(t[step]) > 1 and t[step][0] - t[step][1] < tie
                           for t in (tops_a, tops_b)):
                    return False
                break
    return True


def _print_row(row: dict) -> None:
    status = ("started" if "tokens" in row or "embeddings" in row
              else f"error: {row.get('error', '')[:120]}")
    print(f"[{row['wall_s']:6.1f}s] {row['case']:60s} {status}", flush=True)


def write_report(rows: list[dict], out_dir: str, wall_s: float) -> bool:
    ok = all(not row["verdict"].startswith("FAIL") for row in rows)
    with open(os.path.join(out_dir, "gpu_smoke.json"), "w") as f:
        json.dump({"ok": ok, "wall_s": wall_s, "cases": rows}, f, indent=1)
    lines = ["| case | start s | generate s | first tokens | verdict |", "|---|---|---|---|---|"]
    for row in sorted(rows, key=lambda r: r["case"]):
        first = (row["tokens"][0] if "tokens" in row
                 else [round(x, 4) for x in row["embeddings"][0][:3]] if "embeddings" in row
                 else "-")
        lines.append(f"| {row['case']} | {row.get('start_s', '-')} | "
                     f"{row.get('generate_s', '-')} | {first} | {row['verdict']} |")
    lines.append(f"\n{len(rows)} cases, {wall_s:.0f} s: {'PASS' if ok else 'FAIL'}")
    with open(os.path.join(out_dir, "gpu_smoke.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return ok


def _num_gpus() -> int:
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return len(out.stdout.strip().splitlines()) if out.returncode == 0 else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="gpu_smoke_out")
    parser.add_argument("--cpu", action="store_true", help="the reduced CPU matrix")
    parser.add_argument("--jobs", type=int, default=4, help="cases run side by side at most")
    parser.add_argument("--timeout", type=float, default=300.0, help="per case, seconds")
    parser.add_argument("--only", help="run the cases whose name matches this regex")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--write-checkpoints", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.write_checkpoints:
        print(json.dumps(write_checkpoints(json.loads(args.write_checkpoints), args.out)))
        return 0
    if args.case:
        print("RESULT " + json.dumps(run_case(Case(**json.loads(args.case)))), flush=True)
        return 0
    if args.cpu:
        os.environ["JAX_PLATFORMS"] = "cpu"
    cases = cpu_matrix() if args.cpu else gpu_matrix(_num_gpus())
    cases = [case for case in cases if args.only is None or re.search(args.only, case.name)]
    start = time.perf_counter()
    os.environ[CHECKPOINTS] = json.dumps(_write_checkpoints_apart(cases, args.out))
    rows = run_matrix(cases, args.out, 1 if args.cpu else args.jobs, args.timeout)
    judge(rows)
    return 0 if write_report(rows, args.out, round(time.perf_counter() - start, 1)) else 1


if __name__ == "__main__":
    sys.exit(main())
