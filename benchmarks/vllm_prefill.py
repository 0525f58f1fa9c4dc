"""Inside ``.venv-vllm``: vLLM's offline ``LLM`` on ``benchmarks/prefill.py``'s prefills, the
same prompts, timed and profiled, for the side-by-side table there (``prefill.py
--vllm``, which writes the spec and runs this with ``_servers.VLLM_ENV``).

    .venv-vllm/bin/python benchmarks/vllm_prefill.py SPEC.json OUT.json

The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so torch's
profiler sees its ops: the GEMMs are ``_C::onednn_mm`` and attention, prefill and decode
alike, is ``_C::cpu_attention_with_kv_cache`` (vllm 0.32.0
`v1/attention/backends/cpu_attn.py: CPUAttentionBackendImpl.forward`). The step budget is
its server's on a CPU, 2,048 tokens (the offline default is 4,096: vllm 0.32.0
`engine/arg_utils.py: EngineArgs.get_batch_defaults`). Imports nothing
of minirt's: this file runs in vLLM's environment.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

OPS = {"gemm": "_C::onednn_mm", "attention": "_C::cpu_attention_with_kv_cache"}


def main(spec_path: str, out_path: str) -> None:
    from torch.profiler import ProfilerActivity, profile
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(spec_path) as f:
        spec = json.load(f)
    repeats = spec["repeats"]
    llm = LLM(model=spec["model_path"], dtype="float32", enforce_eager=True,
              enable_prefix_caching=True, max_model_len=4096, seed=0,
              max_num_batched_tokens=2048)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def prefill(prompts: list[list[int]], cached: int) -> float:
        if not cached:
            llm.reset_prefix_cache()
        start = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompts], params,
                            use_tqdm=False)
        seconds = time.perf_counter() - start
        assert all(int(o.num_cached_tokens or 0) == cached for o in outs), \
            "vLLM cached another amount"
        return seconds

    result = {}
    for name, case in spec["cases"].items():
        cached, runs = case["cached"], iter(case["prompts"])
        if cached:
            llm.generate([TokensPrompt(prompt_token_ids=spec["prefix"])], params,
                         use_tqdm=False)
        prefill(next(runs), cached)  # warm-up
        wall = statistics.median(prefill(next(runs), cached) for _ in range(repeats))
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(repeats):
                prefill(next(runs), cached)
        events = prof.key_averages()
        result[name] = {"wall": wall, **{k: sum(e.self_cpu_time_total for e in events
                                                if e.key == op) / 1e6 / repeats
                                         for k, op in OPS.items()}}
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
