"""Inside ``.venv-vllm``: vLLM's offline ``LLM`` on ``benchmarks/decode.py --vllm``'s decode
batches, the same prompts, for the side-by-side table there (``decode.py`` writes the spec
and runs this with ``vs_vllm.VLLM_ENV``).

    .venv-vllm/bin/python benchmarks/vllm_decode.py SPEC.json OUT.json

For each batch size and repeat, one ``generate`` call of ``short`` tokens and one of
``long``, on fresh prompts behind the cached prefixes; their difference over ``long -
short`` is the decode step, prefill and scheduling of admission cancelling out. Imports
nothing of minirt's: this file runs in vLLM's environment.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def main(spec_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(spec_path) as f:
        spec = json.load(f)
    llm = LLM(model=spec["model_path"], dtype="float32", enforce_eager=True,
              enable_prefix_caching=True, max_model_len=4096, seed=0)

    def run(prompts: list[list[int]], tokens: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        start = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                     use_tqdm=False)
        return time.perf_counter() - start

    run(spec["warmup"], spec["short"])  # the prefixes into the cache, the kernels warm
    result = {}
    for batch, reps in spec["batches"].items():
        steps = [(run(long, spec["long"]) - run(short, spec["short"]))
                 / (spec["long"] - spec["short"]) for short, long in reps]
        result[batch] = statistics.median(steps)
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
