"""What the vLLM side-by-side scripts share (``vs_vllm.py``, ``serve_bench.py``, and
``_setup.run_in_vllm``): where vLLM's environment is, how it runs, and its OpenAI server
started and stopped. Standard library only at the top: ``.venv-vllm`` imports it too."""

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


def start_vllm_server(model_path: str) -> tuple[subprocess.Popen, str, Path]:
    """vLLM's OpenAI server on a free local port (fp32, eager, prefix caching on); returns
    the process, its ``/v1`` URL and its log once ``/health`` answers (exits if it dies or
    is not ready in 900 s)."""
    import socket

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = Path(tempfile.mkstemp(prefix="vllm-server-", suffix=".log")[1])
    cmd = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", model_path,
           "--served-model-name", MODEL_NAME, "--dtype", "float32", "--enforce-eager",
           "--enable-prefix-caching", "--enable-prompt-tokens-details", "--max-model-len",
           "4096", "--host", "127.0.0.1", "--port", str(port), "--seed", "0"]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env={**os.environ, **VLLM_ENV}, stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"vLLM server exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc, f"http://127.0.0.1:{port}/v1", log
        except httpx.HTTPError:
            pass
        time.sleep(1)
    stop_group(proc)
    sys.exit(f"vLLM server not ready after 900 s:\n{log.read_text()[-3000:]}")


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the server we started (its own process group: it spawns workers), then KILL."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
