"""Inside ``.venv-vllm``: vLLM's offline ``LLM`` on ``benchmarks/decode.py --vllm``'s decode
batches, the same prompts, for the side-by-side table there (``decode.py`` writes the spec
and runs this with ``_servers.VLLM_ENV``).

    .venv-vllm/bin/python benchmarks/vllm_decode.py SPEC.json OUT.json

For each batch size and repeat, one ``generate`` call of ``short`` tokens and one of
``long``, on fresh prompts behind the cached prefixes; their difference over ``long -
short`` is the decode step, prefill and scheduling of admission cancelling out.

Then the decode step's GEMMs alone: for each batch size, one step's matrix products at the
model's shapes (``spec["gemms"]``: per layer fused q/k/v, o, fused gate/up and down, then
the output head), through the kernel minirt calls (torch's
``mkldnn._linear_pointwise`` on a prepacked weight, ``minirt/model.py: _linear``) and the
one vLLM selects for a float32 Linear on a CPU without AMX or zentorch (``_C.onednn_mm``,
vllm 0.32.0 `model_executor/layers/utils.py: dispatch_cpu_unquantized_gemm`), alternated
in this one process on the same random weights. Imports nothing of minirt's: this file
runs in vLLM's environment.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

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
        json.dump({"steps": result, "gemms": gemm_steps(spec["gemms"])}, f)


def gemm_steps(spec: dict, rounds: int = 5, calls: int = 20) -> dict[str, dict[str, float]]:
    """Per batch size in ``spec["rows"]``: seconds for one decode step's GEMMs (``layers`` x
    the per-layer ``shapes`` [out, in], plus the ``head``), minirt's kernel and vLLM's, the
    best of ``rounds`` alternated rounds of ``calls`` steps each. minirt's is what its
    forward runs: ``minirt.kernels.gemv`` on one row (imported from this checkout; the
    compiled library needs no more than torch), oneDNN on its prepacked weights on more."""
    import torch
    from vllm import _custom_ops as ops

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from minirt.kernels import gemv

    torch.manual_seed(0)  # a weight per layer and shape, as a step reads them all from memory
    shapes = [*[tuple(s) for s in spec["shapes"]] * spec["layers"], tuple(spec["head"])]
    weights = [torch.randn(*s) / s[1] ** 0.5 for s in shapes]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
    handlers = [ops.create_onednn_mm(w.t(), 32) for w in weights]

    def minirt(i: int, x: torch.Tensor) -> torch.Tensor:
        y = gemv(x, weights[i]) if x.shape[0] == 1 else None
        if y is None:
            y = torch.ops.mkldnn._linear_pointwise(x, packed[i], None, "none", [], "")
        return y

    kernels = {"minirt": minirt, "vllm": lambda i, x: ops.onednn_mm(handlers[i], x, None)}
    result = {}
    for rows in spec["rows"]:
        inputs = {s: torch.randn(rows, s[1]) for s in set(shapes)}
        for i, s in enumerate(shapes[-5:], len(shapes) - 5):  # the same products
            torch.testing.assert_close(kernels["minirt"](i, inputs[s]),
                                       kernels["vllm"](i, inputs[s]), rtol=1e-4, atol=1e-4)
        best = {name: float("inf") for name in kernels}
        for _ in range(rounds):
            for name, kernel in kernels.items():
                start = time.perf_counter()
                for _ in range(calls):
                    for i, s in enumerate(shapes):
                        kernel(i, inputs[s])
                best[name] = min(best[name], (time.perf_counter() - start) / calls)
        result[str(rows)] = best
    return result


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
