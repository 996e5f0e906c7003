"""Decode throughput of one engine, transformers' model step captured in a CUDA graph, with its KV
cache in turboquant's FP4 (``PagedKVCache``) against the same model with BF16 and FP8 paged
caches read by FlashInfer's paged decode through the same hook (an attention function that
appends the step's K/V to its pages and runs ``BatchDecodeWithPagedKVCacheWrapper``).

Model: random weights of a real geometry (default Llama-3-8B's: hidden 4096, 32 query / 8 kv
heads, D 128, MLP 14336, vocabulary 128256) with ``--layers`` decoder layers (the weights of all 32
do not fit beside the caches; attention's share of a step grows with the layers kept, so the
speedup of a full model lies between this one's and the attention-only figures of ``bench``).
Caches are filled with random bytes (FP4: random codes, scale bytes 2^-9..2^-1; BF16 / FP8:
normal values), so nothing is prefilled. Per (batch, context, cache): one eager warm-up step, the
step captured, then ``--steps`` steps timed, each = the host's plan for the step (turboquant:
``advance_decode``, in place; FlashInfer: the page indices built with torch on the CPU, then
``plan`` into its fixed buffers, as engines call it once per step) + the graph's replay.
Reported: decode tokens/s (batch / step), the plan's host time and its share of the step, the
GPU's time per step alone (the step replayed back to back, CUDA events) with its tokens/s, and KV
bytes per token slot. FlashInfer's decode runs with tensor cores (its choice for GQA 4). FP8 is
E4M3 with scale 1.0 (vLLM's ``fp8``).

    python benchmarks/generation_throughput.py --batches 8,32,128,256 --contexts 1024,4096,16384
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import turboquant as tq  # noqa: E402
from turboquant.bench.peers import page_indices  # noqa: E402
from turboquant.integration import transformers as tq_hf  # noqa: E402
from turboquant.integration.transformers import PagedKVCache  # noqa: E402

CACHES = ("tq_fp4", "bf16", "fp8")
FI_NAME = "fi_paged_decode"  # (transformers 5.17 reads a name with "flash" as FlashAttention)


def model_of(layers: int, device: str):
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=4096, intermediate_size=14336,
                                   num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                   num_hidden_layers=layers, vocab_size=128256,
                                   max_position_embeddings=131072)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    return model


class FlashInferCache:
    """BF16 or FP8 pages [pages, Hkv, page, D] (HND) per layer, each row a sequence with its own
    pages, read by FlashInfer's paged decode; transformers reaches it through the attention
    function ``fi_attention`` (this study's; the library's cache is PagedKVCache)."""

    def __init__(self, model, rows: int, max_length: int, fmt: str, page: int = 16):
        import flashinfer
        from transformers.cache_utils import Cache, DynamicLayer

        cfg = model.config
        dev = next(model.parameters()).device
        self.fmt, self.page, self.rows = fmt, page, rows
        self.hkv, self.d, self.hq = cfg.num_key_value_heads, cfg.head_dim, cfg.num_attention_heads
        per = math.ceil(max_length / page)
        dtype = torch.bfloat16 if fmt == "bf16" else torch.float8_e4m3fn
        self.k = [torch.empty(rows * per, self.hkv, page, self.d, dtype=dtype, device=dev)
                  for _ in range(cfg.num_hidden_layers)]
        self.v = [torch.empty_like(t) for t in self.k]
        self.table = torch.arange(rows * per, dtype=torch.int32, device=dev).view(rows, per)
        self.lens = torch.zeros(rows, dtype=torch.int32, device=dev)
        self.pos = torch.zeros(rows, dtype=torch.long, device=dev)
        self.indptr = torch.zeros(rows + 1, dtype=torch.int32, device=dev)
        self.indices = torch.zeros(rows * per, dtype=torch.int32, device=dev)
        self.last = torch.zeros(rows, dtype=torch.int32, device=dev)
        self.workspace = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
        self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "HND", use_cuda_graph=True, use_tensor_cores=True,
            paged_kv_indptr_buffer=self.indptr, paged_kv_indices_buffer=self.indices,
            paged_kv_last_page_len_buffer=self.last)
        self.host_lens = torch.zeros(rows, dtype=torch.int32)  # the engine's host-side copy
        self.host_table = self.table.cpu()
        self.hf = Cache(layers=[DynamicLayer() for _ in range(cfg.num_hidden_layers)])
        self.hf.fi = self
        for i in range(cfg.num_hidden_layers):
            self.hf.layers[i].update = self._updater(i)

    def _updater(self, i):
        def update(k, v, *args, **kwargs):  # [B, Hkv, 1, D]: into the pages at pos
            blk = self.table.gather(1, (self.pos // self.page)[:, None])[:, 0].long()
            off = self.pos % self.page
            self.k[i][blk, :, off] = k[:, :, 0].to(self.k[i].dtype)
            self.v[i][blk, :, off] = v[:, :, 0].to(self.v[i].dtype)
            return k, v
        return update

    def fill(self, length: int) -> None:
        gen = torch.Generator(device=self.k[0].device).manual_seed(1)
        for t in self.k + self.v:
            t.copy_(torch.randn(t.shape, generator=gen, device=t.device, dtype=torch.bfloat16))
        self.lens.fill_(length)
        self.host_lens.fill_(length)

    def plan(self) -> None:
        """The next step: its position (in place) and FlashInfer's plan over lengths + 1."""
        self.pos.copy_(self.lens)
        self.lens.add_(1)
        self.host_lens += 1
        indptr, indices, last = page_indices(self.host_table, self.host_lens, self.page)
        self.wrapper.plan(indptr, indices, last, self.hq, self.hkv, self.d, self.page,
                          q_data_type=torch.bfloat16, kv_data_type=self.k[0].dtype,
                          sm_scale=self.d ** -0.5)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    @property
    def token_slots(self) -> int:
        return self.table.numel() * self.page


def fi_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """query [B, Hq, 1, D] -> [B, 1, Hq, D], FlashInfer over the layer's pages."""
    fi = _FI[0]
    i = module.layer_idx
    q = query[:, :, 0]
    kw = {"k_scale": 1.0, "v_scale": 1.0} if fi.fmt == "fp8" else {}
    out = fi.wrapper.run(q.contiguous(), (fi.k[i], fi.v[i]), **kw)
    return out[:, None], None


_FI: list = [None]


def fill_fp4(cache: PagedKVCache, length: int) -> None:
    """Random FP4 codes, scale bytes 118..126 (2^-9..2^-1), every row ``length`` tokens long."""
    gen = torch.Generator(device=cache.buffers[0].device).manual_seed(1)
    for buf in cache.buffers:
        buf.copy_(torch.randint(0, 256, buf.shape, generator=gen, device=buf.device,
                                dtype=torch.uint8))
        nb, hkv, bs, _ = buf.shape
        views = tq.cache_in(buf.view(-1), nb, hkv, bs, cache.head_dim,
                            key_format=cache.key_format)
        for sc in views[2:]:
            sc.copy_(torch.randint(118, 127, sc.shape, generator=gen, device=sc.device,
                                   dtype=torch.uint8))
    cache.lens.fill_(length)
    cache._longest = length
    for layer in cache.layers:
        layer.seen = length


def run_case(model, fmt: str, rows: int, length: int, steps: int) -> dict:
    import transformers

    dev = next(model.parameters()).device
    cfg = model.config
    max_length = length + steps + 2
    if fmt == "tq_fp4":
        d, hkv = cfg.head_dim, cfg.num_key_value_heads
        cal = [(torch.zeros(hkv, d), torch.ones(hkv, d))] * cfg.num_hidden_layers
        cache = PagedKVCache(model, rows, max_length, calibration=cal)
        fill_fp4(cache, length)
        cache.start_decode()
        hf, plan = cache, cache.advance_decode
        nbytes, slots = cache.nbytes, cache.block_table.numel() * cache.block_size
    else:
        transformers.AttentionInterface.register(FI_NAME, fi_attention)
        model.set_attn_implementation(FI_NAME)
        fi = FlashInferCache(model, rows, max_length, fmt)
        fi.fill(length)
        _FI[0] = fi
        hf, plan, nbytes, slots = fi.hf, fi.plan, fi.nbytes, fi.token_slots
    tok = torch.randint(0, cfg.vocab_size, (rows, 1), device=dev)
    pos = torch.full((rows, 1), length, dtype=torch.long, device=dev)

    def step():
        return model(input_ids=tok, position_ids=pos, past_key_values=hf,
                     logits_to_keep=1).logits

    with torch.no_grad():
        plan()
        step()  # eager warm-up
        plan()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        graph.replay()
        torch.cuda.synchronize()
        host = 0.0
        t0 = time.perf_counter()
        for _ in range(steps):
            h0 = time.perf_counter()
            plan()
            host += time.perf_counter() - h0
            pos.add_(1)
            graph.replay()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / steps
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):  # the GPU's part alone: the same step, replayed back to back
            graph.replay()
        stop.record()
        torch.cuda.synchronize()
        gpu = start.elapsed_time(stop) / 1e3 / steps
    del graph
    _FI[0] = None  # nothing keeps this case's caches alive into the next
    tq_hf._ACTIVE.set(None)
    return {"cache": fmt, "batch": rows, "context": length, "step_ms": 1e3 * wall,
            "tokens_per_s": rows / wall, "host_ms": 1e3 * host / steps,
            "host_share": host / steps / wall, "gpu_step_ms": 1e3 * gpu,
            "gpu_tokens_per_s": rows / gpu, "kv_bytes_per_token": nbytes / slots}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="8,32,128,256")
    ap.add_argument("--contexts", default="1024,4096,16384")
    ap.add_argument("--caches", default=",".join(CACHES))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--kv-budget-gib", type=float, default=100.0,
                    help="skip a case whose caches exceed this many GiB")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    model = model_of(args.layers, "cuda")
    rows = []
    for b in map(int, args.batches.split(",")):
        for length in map(int, args.contexts.split(",")):
            for fmt in args.caches.split(","):
                per_token = {"tq_fp4": 8 * 130, "bf16": 8 * 512, "fp8": 8 * 256}[fmt]
                gib = per_token * args.layers * b * (length + args.steps + 2) / 2**30
                if gib > args.kv_budget_gib:
                    rows.append({"cache": fmt, "batch": b, "context": length,
                                 "skipped": f"{gib:.0f} GiB of KV"})
                    print(f"{fmt:7s} B {b:4d} L {length:6d}  skipped ({gib:.0f} GiB)", flush=True)
                    continue
                try:
                    r = run_case(model, fmt, b, length, args.steps)
                except Exception as e:  # a case that fails is reported, the others run
                    r = {"cache": fmt, "batch": b, "context": length,
                         "error": f"{type(e).__name__}: {e}"[:300]}
                    print(f"{fmt:7s} B {b:4d} L {length:6d}  {r['error']}", flush=True)
                else:
                    print(f"{fmt:7s} B {b:4d} L {length:6d}  {r['step_ms']:8.3f} ms/step  "
                          f"{r['tokens_per_s']:9.0f} tok/s  host {r['host_ms']:.3f} ms "
                          f"({100 * r['host_share']:4.1f} %)  GPU {r['gpu_step_ms']:8.3f} ms "
                          f"{r['gpu_tokens_per_s']:9.0f} tok/s  {r['kv_bytes_per_token']:.0f} "
                          f"B/token", flush=True)
                rows.append(r)
                torch.cuda.empty_cache()
    result = {"gpu": torch.cuda.get_device_name(), "layers": args.layers, "rows": rows,
              "torch": torch.__version__}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
