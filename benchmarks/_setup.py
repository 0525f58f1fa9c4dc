"""What the model-timing benchmarks share: torch's threads, the model, the machine line."""

from __future__ import annotations

import os

import torch

from minirt.model import load_model


def timing_model(threads: int | None):
    """Set torch's threads (None: torch's choice), load the default model in fp32 and print
    the device, the threads and the load average the timings are taken under."""
    if threads:
        torch.set_num_threads(threads)
    model, _ = load_model(dtype=torch.float32)
    print(f"device {next(model.parameters()).device}, torch threads {torch.get_num_threads()}, "
          f"load average {os.getloadavg()[0]:.2f} (1 min) on {os.cpu_count()} CPUs")
    return model
