"""What the vLLM side-by-side scripts share (``vs_vllm.py``, ``serve_bench.py``,
``kv_routing.py``, ``kv_routing_live.py`` and ``_setup.run_in_vllm``): where vLLM's
environment is, how it runs, and its OpenAI server started and stopped. Standard library
only at the top: ``.venv-vllm`` imports it too."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
VLLM_ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "2",
            "VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false"}
MODEL_NAME = "SmolLM2-135M-Instruct"
# vLLM's worker spins on its shared-memory queue (sched_yield) for 1 s after its last read
# before it sleeps, busy_loop_s=1 in
# vllm 0.32.0 `distributed/device_communicators/shm_broadcast.py: SpinCondition`
# On 2 cores that takes one from whatever runs next. Every timed run, of either server,
# starts this long after the one before it ends.
QUIET_S = 1.5


def vllm_command(model_path: str, port: int, *extra: str, max_model_len: int = 4096,
                 served_model_name: str = MODEL_NAME) -> list[str]:
    """The command line of vLLM's OpenAI server as every script here starts it (fp32,
    eager, prefix caching on, cached tokens reported per response), ``extra`` appended."""
    return [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model",
            model_path, "--served-model-name", served_model_name, "--dtype", "float32",
            "--enforce-eager", "--enable-prefix-caching", "--enable-prompt-tokens-details",
            "--max-model-len", str(max_model_len), "--host", "127.0.0.1", "--port", str(port),
            "--seed", "0", *extra]


def launch_vllm(cmd: list[str], port: int, env: dict[str, str] | None = None,
                timeout: float = 900) -> tuple[subprocess.Popen, Path]:
    """Run ``cmd`` (``vllm_command``) with ``VLLM_ENV`` (and ``env``) in its own process
    group, its output into a temporary log; returns the process and the log once
    ``/health`` on ``port`` answers. Raises RuntimeError (the process stopped) if it exits
    or is not ready in ``timeout`` seconds."""
    import httpx

    log = Path(tempfile.mkstemp(prefix="vllm-server-", suffix=".log")[1])
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env={**os.environ, **VLLM_ENV, **(env or {})}, stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM server exited ({proc.returncode}):\n"
                               f"{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc, log
        except httpx.HTTPError:
            pass
        time.sleep(1)
    stop_group(proc)
    raise RuntimeError(f"vLLM server not ready after {timeout:.0f} s:\n{log.read_text()[-3000:]}")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_vllm_server(model_path: str) -> tuple[subprocess.Popen, str, Path]:
    """vLLM's OpenAI server on a free local port (``vllm_command``); returns the process,
    its ``/v1`` URL and its log once ``/health`` answers (exits if it dies or is not ready
    in 900 s)."""
    port = free_port()
    try:
        proc, log = launch_vllm(vllm_command(model_path, port), port)
    except RuntimeError as exc:
        sys.exit(str(exc))
    return proc, f"http://127.0.0.1:{port}/v1", log


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the server we started (its own process group: it spawns workers), then KILL."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
