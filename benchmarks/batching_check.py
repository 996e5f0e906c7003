"""Continuous batching with the KV cache in the format on a GPU, under the machine's transformers
(5.17 on the GPU machines here) or 5.23 carried as a site folder: `pip download --no-deps
transformers==5.23.0`, unzip it into site/, `tar -cJf .tfsite/tf523.tar.xz site`, carry .tfsite,
and on the machine unpack it to /tmp/tfsite and put that first on PYTHONPATH.

The small random Llama of tests/test_transformers_batching.py on the GPU: tokens of
``generate_batch`` per prompt against ``PagedKVCache`` per prompt alone, without the decode fast
path and with it (its decode steps then replayed from CUDA graphs). Throughput:
batching_throughput.py.

    python benchmarks/batching_check.py                              # the machine's transformers
    PYTHONPATH=/tmp/tfsite:$PWD python benchmarks/batching_check.py  # 5.23 carried
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import transformers  # noqa: E402
from test_transformers_batching import cb_config  # noqa: E402
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
        cb = cb_config(num_blocks=40, max_batch_tokens=64)
        out = tb.generate_batch(model, [p.tolist() for p in prompts], calibration=cal,
                                sink_entries=4096, generation_config=config,
                                continuous_batching_config=cb, decode_fast_path_blocks=fast)
        got = [o.generated_tokens for o in out.values()]
        print(f"fast path {fast}: tokens equal to PagedKVCache per prompt",
              [sum(a == b for a, b in zip(x, y)) for x, y in zip(got, want)], f"of {new}")


def main() -> None:
    print("transformers", transformers.__version__, flush=True)
    agreement("cuda")


if __name__ == "__main__":
    main()
