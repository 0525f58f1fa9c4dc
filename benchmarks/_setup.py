"""What the model-timing benchmarks share: torch's threads, the model, the machine line,
the profiler's split of a step into GEMMs, attention, K/V traffic and the rest, and
running a peer script in vLLM's environment."""

from __future__ import annotations

import os

import torch

from minirt.model import load_model


def run_in_vllm(script: str, spec: dict) -> dict:
    """Run ``benchmarks/<script>`` in ``.venv-vllm`` (``_servers.VLLM_ENV``) on ``spec``, the
    model's path added, and return the JSON it writes; exit with its stderr if it fails."""
    import json
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    from _servers import VLLM_ENV, VLLM_PYTHON

    from minirt.model import fetch_default_model

    if not VLLM_PYTHON.exists():
        sys.exit(f"{VLLM_PYTHON} is missing: `make peer-vllm` builds .venv-vllm")
    spec_file, out = (Path(tempfile.mkstemp(suffix=".json")[1]) for _ in range(2))
    spec_file.write_text(json.dumps({**spec, "model_path": str(fetch_default_model())}))
    done = subprocess.run([str(VLLM_PYTHON), str(Path(__file__).with_name(script)),
                           str(spec_file), str(out)], capture_output=True, text=True,
                          env={**os.environ, **VLLM_ENV})
    if done.returncode != 0:
        sys.exit(f"{script} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def timing_model(threads: int | None):
    """Set torch's threads (None: torch's choice), load the default model in fp32 and print
    the device, the threads and the load average the timings are taken under."""
    if threads:
        torch.set_num_threads(threads)
    model, _ = load_model(dtype=torch.float32)
    print(f"device {next(model.parameters()).device}, torch threads {torch.get_num_threads()}, "
          f"load average {os.getloadavg()[0]:.2f} (1 min) on {os.cpu_count()} CPUs")
    return model


GROUPS = {
    "linear layers (GEMMs)": ("aten::mm", "aten::addmm", "aten::linear",
                              "mkldnn::_linear_pointwise"),
    "attention": ("minirt::attention", "aten::_scaled_dot_product_flash_attention_for_cpu",
                  "aten::_scaled_dot_product_attention_math",
                  "aten::_scaled_dot_product_efficient_attention",
                  "aten::_scaled_dot_product_flash_attention",
                  "aten::bmm", "aten::baddbmm", "aten::_softmax", "aten::softmax",
                  "aten::exp", "aten::amax", "aten::maximum", "aten::masked_fill"),
    "K/V traffic (gather, write, append)": ("aten::index_select", "aten::index",
                                            "aten::index_copy_", "aten::index_put_",
                                            "aten::cat", "aten::_index_put_impl_"),
}


def print_split(events, wall: float, steps: int,
                flops: dict[str, float] | None = None) -> dict[str, float]:
    """Print where ``steps`` profiled steps of ``wall`` seconds each went: each group's
    self time per step and share, the other ops, the time outside any op, and, for groups
    in ``flops`` (FLOP per step), the rate achieved. Returns each group's seconds per step."""
    in_ops = sum(e.self_cpu_time_total for e in events) / 1e6 / steps
    flops, seconds = flops or {}, {}
    for label, names in GROUPS.items():
        t = sum(e.self_cpu_time_total for e in events if e.key in names) / 1e6 / steps
        calls = sum(e.count for e in events if e.key in names) / steps
        seconds[label] = t
        rate = f", {flops[label] / t / 1e9:.0f} GFLOP/s" if label in flops and t else ""
        print(f"   {label:<40} {t * 1e3:7.1f} ms {100 * t / wall:5.1f}%  "
              f"({calls:.0f} calls per step{rate})")
    shown = sum(seconds.values())
    print(f"   {'other ops (norms, RoPE, copies, ...)':<40} {(in_ops - shown) * 1e3:7.1f} ms "
          f"{100 * (in_ops - shown) / wall:5.1f}%")
    print(f"   {'outside ops (Python, framework)':<40} {(wall - in_ops) * 1e3:7.1f} ms "
          f"{100 * (wall - in_ops) / wall:5.1f}%")
    top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:8]
    print("   top ops by self time: " + ", ".join(
        f"{e.key} {e.self_cpu_time_total / 1e3 / steps:.1f} ms" for e in top))
    return seconds
