"""Continuous batching with the KV cache in the format on a GPU (transformers 5.23; the GPU
machines have 5.17, so carry 5.23 as a site folder: `pip download --no-deps
transformers==5.23.0`, unzip it into site/, `tar -cJf .tfsite/tf523.tar.xz site`, carry .tfsite,
and on the machine unpack it to /tmp/tfsite and put that first on PYTHONPATH).

1. The small random Llama of tests/test_transformers_batching.py on the GPU: tokens of
   ``generate_batch`` per prompt against ``PagedKVCache`` per prompt alone, with and without the
   decode fast path.
2. Wall time of ``generate_batch`` (prefill included), a random Llama-3-8B geometry with
   ``--layers`` layers in bf16, ``--prompts`` random prompts of ``--prompt-tokens`` tokens and
   ``--new-tokens`` each: turboquant FP4 against transformers' own continuous batching (BF16
   cache, sdpa), two runs each.

    PYTHONPATH=/tmp/tfsite:$PWD python benchmarks/batching_check.py
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import transformers  # noqa: E402
from test_transformers_integration import LENS, batch, calibration, tiny_llama  # noqa: E402

from turboquant.integration import transformers_batching as tb  # noqa: E402
from turboquant.integration.transformers import PagedKVCache  # noqa: E402


def agreement(dev: str, new: int = 8) -> None:
    gen = torch.Generator().manual_seed(4)
    model = tiny_llama().to(dev)
    cal = calibration(model, gen)
    ids, _ = batch(gen)
    prompts = [ids[i, -n:] for i, n in enumerate(LENS)]
    want = []
    for p in prompts:
        cache = PagedKVCache(model, 1, 128, calibration=cal, sink_entries=4096)
        with torch.no_grad():
            out = model.generate(input_ids=p[None].to(dev), past_key_values=cache,
                                 max_new_tokens=new, min_new_tokens=new, do_sample=False)
        want.append(out[0, len(p):].tolist())
    config = transformers.GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1,
                                           pad_token_id=0)
    for fast in (0, 16):
        model.set_attn_implementation("sdpa")
        cb = transformers.ContinuousBatchingConfig(page_size=16, num_blocks=40,
                                                   max_batch_tokens=64)
        out = tb.generate_batch(model, [p.tolist() for p in prompts], calibration=cal,
                                sink_entries=4096, generation_config=config,
                                continuous_batching_config=cb, decode_fast_path_blocks=fast)
        got = [o.generated_tokens for o in out.values()]
        print(f"fast path {fast}: tokens equal to PagedKVCache per prompt",
              [sum(a == b for a, b in zip(x, y)) for x, y in zip(got, want)], f"of {new}")


def timing(dev: str, args) -> None:
    cfg = transformers.LlamaConfig(hidden_size=4096, intermediate_size=14336,
                                   num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                   num_hidden_layers=args.layers, vocab_size=128256)
    torch.manual_seed(0)
    with torch.device(dev):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    inputs = [torch.randint(0, cfg.vocab_size, (args.prompt_tokens,)).tolist()
              for _ in range(args.prompts)]
    config = transformers.GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False,
                                           eos_token_id=-1, pad_token_id=0)
    for name in ("tq_fp4", "transformers bf16 sdpa"):
        for run in range(2):
            model.set_attn_implementation("sdpa")
            cb = transformers.ContinuousBatchingConfig(page_size=16, max_batch_tokens=8192)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            if name == "tq_fp4":
                out = tb.generate_batch(model, inputs, generation_config=config,
                                        continuous_batching_config=cb,
                                        decode_fast_path_blocks=args.fast_path_blocks)
            else:
                out = model.generate_batch(inputs, generation_config=config,
                                           continuous_batching_config=cb)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            n = sum(len(o.generated_tokens) for o in out.values())
            print(f"{name} run {run}: {n} tokens in {dt:.2f} s = {n / dt:.0f} tokens/s "
                  f"(prefill included)", flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--fast-path-blocks", type=int, default=64)
    args = ap.parse_args(argv)
    print("transformers", transformers.__version__, flush=True)
    agreement("cuda")
    timing("cuda", args)


if __name__ == "__main__":
    main()
