"""A worker run in .venv-vllm by ``kv_routing.py --vllm``: vLLM's own KV events, captured.

Starts ``LLM(...)`` with prefix caching, the spec's block size (vLLM's CPU attention wants
a multiple of 32) and
``kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq", ...}``
(vllm 0.32.0 `config/kv_events.py: KVEventsConfig`), subscribes to its PUB socket,
generates the spec's prompts (token ids) one at a time, resets the prefix cache (and runs
one short step so that vLLM publishes it), and writes every frame received as hex to the
output file.
"""

from __future__ import annotations

import json
import sys
import time


def main(spec_path: str, out_path: str) -> None:
    import zmq
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(spec_path) as f:
        spec = json.load(f)
    endpoint = f"tcp://*:{spec['port']}"
    llm = LLM(model=spec["model_path"], dtype="float32", enforce_eager=True,
              enable_prefix_caching=True, max_model_len=2048, seed=0, block_size=spec["block_size"],
              kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq",
                                "endpoint": endpoint, "topic": "kv"})
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(f"tcp://127.0.0.1:{spec['port']}")
    time.sleep(1.0)
    frames = []

    def drain(seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if sub.poll(100):
                frames.append([f.hex() for f in sub.recv_multipart()])

    params = SamplingParams(temperature=0, max_tokens=spec["max_tokens"], ignore_eos=True)
    outputs = []
    for ids in spec["prompts"]:
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
        outputs.append({"cached": int(out.num_cached_tokens or 0),
                        "output_ids": list(out.outputs[0].token_ids)})
        drain(1.0)
    llm.reset_prefix_cache()
    # the scheduler publishes a step's events at the end of the next step: run one whose
    # prompt fills no block, so AllBlocksCleared is the only news
    llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])],
                 SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    drain(2.0)
    with open(out_path, "w") as f:
        json.dump({"frames": frames, "outputs": outputs}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
