"""Inside ``.venv-vllm``: vLLM's offline ``LLM`` on ``benchmarks/prefill.py``'s two prefills,
timed and profiled, for the side-by-side table there (``prefill.py --vllm``).

    .venv-vllm/bin/python benchmarks/vllm_prefill.py MODEL_PATH OUT.json [REPEATS]

The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so torch's
profiler sees its ops: the GEMMs are ``_C::onednn_mm`` and attention, prefill and decode
alike, is ``_C::cpu_attention_with_kv_cache`` (vllm 0.32.0
`v1/attention/backends/cpu_attn.py: CPUAttentionBackendImpl.forward`). Imports nothing
of minirt's: this file runs in vLLM's environment.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

os.environ.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                   "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_LOGGING_LEVEL": "WARNING"})

OPS = {"gemm": "_C::onednn_mm", "attention": "_C::cpu_attention_with_kv_cache"}


def main(model_path: str, out_path: str, repeats: int) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model_path, dtype="float32", enforce_eager=True, enable_prefix_caching=True,
              max_model_len=4096, seed=0)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    gen = torch.Generator().manual_seed(3)
    vocab = llm.llm_engine.model_config.get_vocab_size()

    def tokens(n: int) -> list[int]:
        return torch.randint(1000, vocab, (n,), generator=gen).tolist()

    prefix = tokens(512)
    cases = {"576 tokens, nothing cached": (lambda: tokens(576), 0),
             "64 tokens behind 512 cached": (lambda: prefix + tokens(64), 512)}

    def prefill(ids: list[int], cached: int) -> float:
        if not cached:
            llm.reset_prefix_cache()
        start = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
        seconds = time.perf_counter() - start
        assert int(out.num_cached_tokens or 0) == cached, "vLLM cached another amount"
        return seconds

    result = {}
    for name, (prompt, cached) in cases.items():
        if cached:
            llm.generate([TokensPrompt(prompt_token_ids=prefix)], params, use_tqdm=False)
        prefill(prompt(), cached)  # warm-up
        wall = statistics.median(prefill(prompt(), cached) for _ in range(repeats))
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(repeats):
                prefill(prompt(), cached)
        events = prof.key_averages()
        result[name] = {"wall": wall, **{k: sum(e.self_cpu_time_total for e in events
                                                if e.key == op) / 1e6 / repeats
                                         for k, op in OPS.items()}}
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 3)
