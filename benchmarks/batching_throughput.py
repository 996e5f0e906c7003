"""Decode throughput through transformers' continuous batching (``generate_batch``; its
FlashInfer pages subclass transformers 5.23's allocator, so 5.23, carried to the GPU machines as
batching_check.py says): turboquant's FP4 cache against BF16 and FP8 pages read by FlashInfer
through the same hook (``transformers_batching.run_batch`` with this file's cache and attention
function), decode steps on transformers' block-table path and captured in CUDA graphs for all
three.

Model: random weights of Llama-3-8B's geometry (32 / 8 heads, D 128) with ``--layers`` layers,
bf16. Per (cache, B x L): B random prompts of L tokens and ``--new-tokens`` tokens each;
``max_batch_tokens`` holds every prompt, so the prefills run in one step and the decode steps
after it hold the whole batch (with chunked prefill, transformers' scheduler starts some requests'
decodes while others prefill, and the batch never decodes together). Every step is timed:
wall = from its start to the next step's start (transformers' scheduling and input tensors, the
plan - for FlashInfer its page indices built on the host and ``plan`` -, the graph's replay, the
read-back of the sampled tokens), GPU = CUDA events around the step's compute. Reported over the
decode steps that hold at least 7/8 of the B requests, the first two left out (graph capture):
tokens/s = rows / wall, GPU tokens/s = rows / GPU, the host's share of the step (1 - GPU /
wall), the plan's ms.
``--check``: FlashInfer BF16 through this hook against transformers' own continuous batching
(sdpa) on a small case, greedy tokens equal.

    PYTHONPATH=/tmp/tfsite:$PWD python benchmarks/batching_throughput.py --check
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import transformers  # noqa: E402
from transformers.generation.continuous_batching import continuous_api, model_runner  # noqa: E402

from turboquant.integration import transformers_batching as tb  # noqa: E402
from turboquant.integration import transformers_cb_cache as cbc  # noqa: E402
from turboquant.bench.peers import page_indices  # noqa: E402
from generation_throughput import model_of  # noqa: E402  (this folder, first on sys.path)

PAGE = 16
WORKSPACE_BYTES = 128 << 20
FI_NAME = "fi_cb"
CACHES = ("tq_fp4", "bf16", "fp8")


class FIAllocator(cbc.Allocator):
    """BF16 or FP8 pages: a layer's range as [2, blocks, Hkv, page, D] (K pages, V pages)."""

    dtype = torch.bfloat16

    @classmethod
    def bytes_per_token_head(cls, head_dim: int) -> int:
        return 2 * head_dim * cls.dtype.itemsize

    def layer_view(self, layer_bytes, blocks):
        return layer_bytes.view(self.dtype).view(2, blocks, self.num_key_value_heads,
                                                 self.tokens_per_page, self.head_dim)


class FICache(cbc.Cache):
    """transformers' paged cache holding BF16 or FP8 pages, read by FlashInfer: the host-side
    rows of each step (request, KV length) are kept to plan FlashInfer before the step runs."""

    def __init__(self, *args, fmt: str, num_heads: int, **kwargs):
        dtype = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}[fmt]
        self.allocator_class = type(f"FIAllocator_{fmt}", (FIAllocator,), {"dtype": dtype})
        super().__init__(*args, key_format=fmt, **kwargs)
        import flashinfer

        self.fi, self.kv_dtype, self.num_heads = flashinfer, dtype, num_heads
        self.pending: list = []  # (block ids, KV length, query length) per request of the step
        self.decode: dict = {}  # padded batch -> its CUDA-graph-safe decode wrapper
        dev = self.allocator.buffers[0].device
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=dev), "HND",
            backend="fa2" if fmt == "fp8" else "auto")
        self.trash_slot = self.allocator.blocks_per_sector * PAGE  # sector 1: never read
        self.step_wrapper = None

    def extend_read_and_write_indices(self, request_id, past_length, query_length, read_index,
                                      write_index):
        super().extend_read_and_write_indices(request_id, past_length, query_length,
                                              read_index, write_index)
        self._plan_row(request_id, past_length, query_length)

    def fill_block_table(self, request_id, past_length, query_length, block_table):
        super().fill_block_table(request_id, past_length, query_length, block_table)
        self._plan_row(request_id, past_length, query_length)

    def _plan_row(self, request_id, past_length, query_length):
        self.pending.append((list(self.allocator.block_table[request_id]),
                             past_length + query_length, query_length))

    def _decode_wrapper(self, rows: int):
        if rows not in self.decode:
            dev = self.allocator.buffers[0].device
            blocks = self.max_blocks_per_request
            buf = {"paged_kv_indptr_buffer": torch.zeros(rows + 1, dtype=torch.int32,
                                                         device=dev),
                   "paged_kv_indices_buffer": torch.zeros(rows * blocks, dtype=torch.int32,
                                                          device=dev),
                   "paged_kv_last_page_len_buffer": torch.zeros(rows, dtype=torch.int32,
                                                                device=dev)}
            self.decode[rows] = self.fi.BatchDecodeWithPagedKVCacheWrapper(
                torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=dev), "HND",
                use_cuda_graph=True, use_tensor_cores=True, **buf)
        return self.decode[rows]

    def plan_step(self, decode: bool, padded_rows: int) -> None:
        """FlashInfer's plan of the prepared step (host page indices, then ``plan``); a decode
        step's padding rows read one trash page."""
        rows, self.pending = self.pending, []
        tables = [t for t, _, _ in rows]
        lens, q_lens = [n for _, n, _ in rows], [q for _, _, q in rows]
        if decode:
            pad = padded_rows - len(rows)
            tables, lens = tables + [[self.trash_slot // PAGE]] * pad, lens + [1] * pad
        table = torch.zeros(len(tables), max(map(len, tables)), dtype=torch.int32)
        for i, t in enumerate(tables):
            table[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
        indptr, indices, last = page_indices(table, torch.tensor(lens, dtype=torch.int32), PAGE)
        a = self.allocator
        common = dict(q_data_type=torch.bfloat16, kv_data_type=self.kv_dtype,
                      sm_scale=a.head_dim ** -0.5)
        if decode:
            self.step_wrapper = self._decode_wrapper(padded_rows)
            self.step_wrapper.plan(indptr, indices, last, self.num_heads,
                                   a.num_key_value_heads, a.head_dim, PAGE, **common)
        else:
            qo = torch.zeros(len(rows) + 1, dtype=torch.int32)
            qo[1:] = torch.cumsum(torch.tensor(q_lens, dtype=torch.int32), 0)
            self.prefill.plan(qo, indptr, indices, last, self.num_heads, a.num_key_value_heads,
                              a.head_dim, PAGE, causal=True, **common)
            self.step_wrapper = self.prefill


def fi_attention(module, query, key, value, attention_mask, scaling=None, *, cache=None,
                 cu_seq_lens_q=None, cu_seq_lens_k=None, max_length_k=None, write_index=None,
                 position_ids=None, block_table=None, **kwargs):
    """query [1, Hq, T, D], key and value [1, Hkv, T, D] -> [1, T, Hq, D]: the step's K/V into
    the layer's pages (padding into the trash sector), then FlashInfer as planned."""
    i, t = module.layer_idx, query.shape[2]
    if i == 0:
        meta = tb.step_metadata(cache, t, cu_seq_lens_q, cu_seq_lens_k, max_length_k,
                                write_index, position_ids, block_table)
        slots = meta.slot_mapping[:t]
        cache.slots = torch.where(slots >= 0, slots, cache.trash_slot)
        cache.real_tokens = int(cu_seq_lens_q[-1]) if block_table is None else t
    k_pages, v_pages = cache.buffers[i]
    blk, off = cache.slots // PAGE, cache.slots % PAGE
    k_pages[blk, :, off] = key[0].transpose(0, 1).to(cache.kv_dtype)
    v_pages[blk, :, off] = value[0].transpose(0, 1).to(cache.kv_dtype)
    q = query[0].transpose(0, 1)[:cache.real_tokens].contiguous()
    kw = {"k_scale": 1.0, "v_scale": 1.0} if cache.kv_dtype != torch.bfloat16 else {}
    out = cache.step_wrapper.run(q, (k_pages, v_pages), **kw)
    if out.shape[0] < t:  # varlen padding rows
        out = torch.cat([out, out.new_zeros(t - out.shape[0], *out.shape[1:])])
    return out[None], None


class StepClock:
    """Times every step of the batch processor: its start (``_generation_step``), the plan and
    the GPU's part (``ModelRunner.compute_batch``, which transformers' warm-up also calls: a
    cache with ``plan_step`` is planned there too). Class-level patches while in the block."""

    def __init__(self):
        self.steps: list = []
        self.in_step = False

    def __enter__(self):
        self.orig_step = continuous_api.ContinuousBatchProcessor._generation_step
        self.orig_compute = model_runner.ModelRunner.compute_batch
        clock = self

        def step(bp, model):
            io = bp.inputs_and_outputs
            clock.steps.append({"start": time.perf_counter(), "decode": bool(io.use_block_table),
                                "rows": io.num_request_in_batch, "plan": 0.0})
            clock.in_step = True
            try:
                clock.orig_step(bp, model)
            finally:
                clock.in_step = False

        def compute(runner, model, batch_data):
            io = runner.inputs_and_outputs
            t0 = time.perf_counter()
            plan = getattr(runner.cache, "plan_step", None)
            if plan is not None:
                plan(bool(io.use_block_table), io.num_q_tokens)
            t1 = time.perf_counter()
            stream = io.compute_stream or torch.cuda.current_stream()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record(stream)
            clock.orig_compute(runner, model, batch_data)
            e1.record(stream)
            if clock.in_step:
                clock.steps[-1].update(plan=t1 - t0, events=(e0, e1))

        continuous_api.ContinuousBatchProcessor._generation_step = step
        model_runner.ModelRunner.compute_batch = compute
        return self

    def __exit__(self, *exc):
        continuous_api.ContinuousBatchProcessor._generation_step = self.orig_step
        model_runner.ModelRunner.compute_batch = self.orig_compute

    def decode_stats(self, batch: int) -> dict:
        """Over the decode steps holding at least 7/8 of the batch, the first two left out."""
        torch.cuda.synchronize()
        full = [k for k, s in enumerate(self.steps[:-1])
                if s["decode"] and s["rows"] >= batch - batch // 8 and "events" in s][2:]
        if not full:
            seen = sorted({(s["decode"], s["rows"]) for s in self.steps})
            raise RuntimeError(f"no decode step held 7/8 of the {batch} requests: (decode, "
                               f"rows) seen {seen}")
        n = len(full)
        rows = sum(self.steps[k]["rows"] for k in full) / n
        wall = sum(self.steps[k + 1]["start"] - self.steps[k]["start"] for k in full) / n
        gpu = sum(self.steps[k]["events"][0].elapsed_time(self.steps[k]["events"][1])
                  for k in full) / n / 1e3
        plan = sum(self.steps[k]["plan"] for k in full) / n
        return {"decode_steps": n, "rows": rows, "step_ms": 1e3 * wall,
                "tokens_per_s": rows / wall, "gpu_step_ms": 1e3 * gpu,
                "gpu_tokens_per_s": rows / gpu, "host_share": 1 - gpu / wall,
                "plan_ms": 1e3 * plan}


def run(model, cache: str, prompts: list, new: int, graphs: bool = True) -> dict:
    """generate_batch of ``prompts`` with ``new`` tokens each through ``cache``; outputs and
    the step clock."""
    cfg = model.config
    longest = max(map(len, prompts)) + new
    blocks = math.ceil(longest / PAGE) + 1
    cb = transformers.ContinuousBatchingConfig(
        page_size=PAGE, num_blocks=len(prompts) * blocks + 64,
        max_batch_tokens=sum(map(len, prompts)) + len(prompts),
        max_requests_per_batch=len(prompts),
        use_cuda_graph=(False, True) if graphs else False)
    gen = transformers.GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1,
                                        pad_token_id=0)
    model.set_attn_implementation("sdpa")
    with StepClock() as clock, torch.no_grad():
        t0 = time.perf_counter()
        if cache == "tq_fp4":
            out = tb.generate_batch(model, prompts, generation_config=gen,
                                    continuous_batching_config=cb, decode_fast_path_blocks=blocks)
        elif cache == "hf_sdpa":  # transformers' own: BF16 cache, its index path
            cb.use_cuda_graph = False
            out = model.generate_batch(prompts, generation_config=gen,
                                       continuous_batching_config=cb)
        else:
            factory = functools.partial(FICache, fmt=cache, num_heads=cfg.num_attention_heads)
            out = tb.run_batch(model, prompts, FI_NAME, fi_attention, factory,
                               generation_config=gen, continuous_batching_config=cb,
                               decode_fast_path_blocks=blocks)
        torch.cuda.synchronize()
        total = time.perf_counter() - t0
    return {"outputs": [o.generated_tokens for o in out.values()], "clock": clock,
            "total_s": total}


def check(model) -> None:
    """FlashInfer BF16 through this hook against transformers' own continuous batching."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=gen).tolist()
               for n in (1, 54, 97, 300)]
    ours = run(model, "bf16", prompts, 8)["outputs"]
    theirs = run(model, "hf_sdpa", prompts, 8, graphs=False)["outputs"]
    same = [sum(a == b for a, b in zip(x, y)) for x, y in zip(ours, theirs)]
    print(f"check: FlashInfer bf16 via the hook vs transformers' sdpa CB, tokens equal {same} "
          f"of 8", flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="32x1024,128x1024,32x4096,128x4096,32x16384",
                    help="B x L, comma-separated")
    ap.add_argument("--caches", default=",".join(CACHES))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    print("transformers", transformers.__version__, torch.cuda.get_device_name(), flush=True)
    model = model_of(args.layers, "cuda")
    if args.check:
        check(model)
    rows = []
    for case in args.cases.split(","):
        b, length = map(int, case.split("x"))
        gen = torch.Generator().manual_seed(b + length)
        prompts = [torch.randint(0, model.config.vocab_size, (length,), generator=gen).tolist()
                   for _ in range(b)]
        for cache in args.caches.split(","):
            try:
                r = run(model, cache, prompts, args.new_tokens)
                stats = r["clock"].decode_stats(b)
            except Exception as e:  # a case that fails is reported, the others run
                row = {"cache": cache, "batch": b, "context": length,
                       "error": f"{type(e).__name__}: {e}"[:300]}
                print(f"{cache:7s} {b:4d} x {length:6d}  {row['error']}", flush=True)
            else:
                row = {"cache": cache, "batch": b, "context": length,
                       "total_s": r["total_s"], **stats}
                print(f"{cache:7s} {b:4d} x {length:6d}  {stats['rows']:5.1f} rows "
                      f"{stats['step_ms']:7.2f} ms/step "
                      f"{stats['tokens_per_s']:8.0f} tok/s  GPU {stats['gpu_step_ms']:7.2f} ms "
                      f"{stats['gpu_tokens_per_s']:8.0f} tok/s  host "
                      f"{100 * stats['host_share']:4.1f} %  plan {stats['plan_ms']:.2f} ms  "
                      f"({stats['decode_steps']} steps, run {r['total_s']:.1f} s)", flush=True)
            rows.append(row)
            torch.cuda.empty_cache()
            if args.json:  # after every row: a call cut short keeps what it measured
                Path(args.json).write_text(json.dumps({"gpu": torch.cuda.get_device_name(),
                                                       "layers": args.layers, "rows": rows},
                                                      indent=1))


if __name__ == "__main__":
    main()
