"""minirt's own CPU kernels (``csrc/``): attention and a layer's small operations,
compiled on first use.

Torch's CPU flash-attention kernel runs a 576-token prefill's attention at about 66
GFLOP/s on an AVX-512 machine, 2.4x the time of vLLM's C++ kernel for the same work
(``benchmarks/prefill.py --vllm``), and a decode step's attention, a few query rows over
many keys, at a quarter of the memory bandwidth. ``attention`` (``csrc/attention.c``) is
prefill's computation written for the shapes minirt sends: the query heads of a K/V head
as the rows of one tile, keys read once for them. ``decode`` (``csrc/decode.c``) is a
decode step's: each row over its group's prefix, then its own keys, in one pass.
``rms_norm``, ``rope`` and ``silu_mul`` (``csrc/layer.c``) are a layer's small elementwise
operations, each one pass where torch runs several operators, and ``gemv``
(``csrc/gemv.c``) a linear layer on one row, which streams the weights faster than
oneDNN's product. They are built with the C compiler (``$CC``, else ``cc``) at ``-O3
-march=native -fopenmp`` into ``cache_dir()/kernels``, named by a hash of the sources,
the flags and the CPU, and loaded with ctypes; their OpenMP calls go to the
``libgomp.so.1`` torch has already loaded, so they run on torch's threads. Where there
is no compiler, the build or the load fails (logged at INFO), ``MINIRT_KERNELS=0`` is
set, or the tensors are not fp32 on the CPU, they return None (``rope``: False) and the
caller uses torch's operations: the same values to within rounding. The book's
appendix 06b (``chapters/06b_kernels.ipynb``) explains each one and checks it.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

from minirt.model import cache_dir

CSRC = Path(__file__).with_name("csrc")
SOURCES = (CSRC / "attention.c", CSRC / "decode.c", CSRC / "layer.c", CSRC / "gemv.c")
HEADERS = (CSRC / "vec.h",)
# -Werror=vla: an array sized by a variable stays on the stack, its vectors out of registers
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-Werror=vla")
LIBS = ("-lm",)
log = logging.getLogger(__name__)
PROFILER_NAME = "minirt::attention"  # how the kernels' calls show in torch's profiler
_NONE = torch.zeros(0, dtype=torch.int64)  # no groups: no rows, sizes or lengths
_P = ctypes.c_void_p


def _cpu_id() -> str:
    """What the compiled code depends on beyond its source: the machine and, on Linux,
    the CPU's feature flags (a cache shared between machines keeps one build per CPU)."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = line
                break
    except OSError:
        pass
    return f"{platform.machine()} {flags}"


_profiling = getattr(torch._C._autograd, "_profiler_enabled", lambda: True)


def _profiled() -> contextlib.AbstractContextManager:
    """A kernel call as ``PROFILER_NAME`` in torch's profiler while it records (the record
    costs about 6 us a call, a fifth of a small decode attention's)."""
    if _profiling():
        return torch.profiler.record_function(PROFILER_NAME)
    return contextlib.nullcontext()


def _unit_stride(*xs: torch.Tensor) -> list[torch.Tensor]:
    """Each of ``xs`` with its last dimension contiguous, as the kernels read it (copied
    only where it is not)."""
    return [x if x.stride(-1) == 1 else x.contiguous() for x in xs]


def _cpu_int64(*xs: torch.Tensor) -> list[torch.Tensor]:
    """Each of ``xs`` as a contiguous int64 tensor on the CPU (no copy where it is one)."""
    return [x.to("cpu", torch.int64).contiguous() for x in xs]


@cache
def library(flags: tuple[str, ...] = FLAGS) -> ctypes.CDLL | None:
    """The compiled kernels, built once per sources, ``flags`` and CPU; None where they
    cannot be built or ``MINIRT_KERNELS=0``. (Other flags than ``FLAGS``: the tests build
    the narrower vectors other CPUs get, ``-march=x86-64`` for example.)"""
    if os.environ.get("MINIRT_KERNELS", "1") == "0":
        return None
    cc = os.environ.get("CC", "cc")
    sources = [p.read_bytes() for p in (*SOURCES, *HEADERS)]
    key = hashlib.sha256(b"\0".join([*sources, " ".join((cc, *flags, *LIBS)).encode(),
                                     _cpu_id().encode()])).hexdigest()[:16]
    folder = cache_dir() / "kernels"
    path = folder / f"kernels-{key}.so"
    if not path.exists():
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=folder) as tmp:  # built aside, then moved
                out = Path(tmp) / path.name
                subprocess.run([cc, *flags, "-o", str(out), *map(str, SOURCES), *LIBS], check=True,
                               capture_output=True, timeout=120)
                os.replace(out, path)
        except (OSError, subprocess.SubprocessError) as e:
            detail = getattr(e, "stderr", b"") or b""
            log.info("minirt's kernels were not built (%s); torch's kernels run. %s",
                     e, detail.decode(errors="replace")[-2000:])
            return None
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        log.info("minirt's kernels did not load (%s); torch's kernels run.", e)
        return None
    lib.minirt_attention.restype = ctypes.c_int
    lib.minirt_attention.argtypes = [_P] * 12 + [ctypes.c_float, ctypes.c_int, ctypes.c_int]
    lib.minirt_decode.restype = ctypes.c_int
    lib.minirt_decode.argtypes = [_P] * 12 + [ctypes.c_float, ctypes.c_int]
    i64, f32, i32 = ctypes.c_int64, ctypes.c_float, ctypes.c_int
    lib.minirt_rms_norm.restype = lib.minirt_rope.restype = lib.minirt_silu_mul.restype = None
    lib.minirt_rms_norm.argtypes = [_P] * 4 + [i64] * 5 + [f32, i32]
    lib.minirt_rope.argtypes = [_P] + [i64] * 5 + [_P, _P, i64, i32]
    lib.minirt_silu_mul.argtypes = [_P] * 3 + [i64] * 5 + [i32]
    lib.minirt_gemv.restype = ctypes.c_int
    lib.minirt_gemv.argtypes = [_P] * 4 + [i64] * 3 + [i32]
    return lib


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              scale: float, causal: bool,
              prefix: tuple[torch.Tensor, ...] | None = None,
              ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``attention_lse`` (``minirt/attention.py``) by minirt's kernel: the output ``[b,
    heads, m, d]`` (laid out ``[b, m, heads, d]``, as torch's flash kernel lays it) and
    the log-sum-exp ``[b, heads, m]``; None for what the kernel does not take, left to
    torch: not fp32 on the CPU, a mask that differs between heads, no kernel, and a
    decode step's few query rows per K/V head (16 or fewer: a task could not fill the
    kernel's two vectors of rows, and torch's kernel runs them faster).

    ``prefix``: ``(pool_k, pool_v, slots)`` or ``(pool_k, pool_v, slots, lengths)``, a KV
    pool layer's ``[capacity, kv_heads, d]`` and the slots of cached keys that each
    sequence's queries see before its ``k``, ``v`` (``mask`` and ``causal`` apply to
    those only), read in place in the same pass: no gathered copy, no second attention
    to merge. ``slots`` ``[P]`` is one prefix for every sequence; ``[b, P]`` with
    ``lengths`` ``[b]`` gives sequence ``i`` the first ``lengths[i]`` of row ``i``."""
    b, heads, m, d = q.shape
    kv_heads, n = k.shape[1], k.shape[2]
    pk, pv, slots, *lengths = prefix if prefix is not None else \
        ((k.new_empty(0, kv_heads, d),) * 2 + (_NONE,))
    if (q.device.type != "cpu" or pk.device.type != "cpu"
            or {q.dtype, k.dtype, v.dtype, pk.dtype, pv.dtype} != {torch.float32}
            or k.shape != v.shape or k.shape[0] != b or k.shape[3] != d
            or n == 0 or heads % kv_heads or (causal and m != n) or heads // kv_heads * m <= 16
            or pk.shape != pv.shape or pk.shape[1:] != (kv_heads, d)
            or not ((slots.dim() == 1 and not lengths)  # one prefix for all, or a row each
                    or (slots.dim() == 2 and len(lengths) == 1
                        and slots.shape[0] == b == lengths[0].numel()))
            or (mask is not None and (mask.dtype != torch.float32 or mask.dim() != 4
                                      or mask.shape[1] != 1))):
        return None
    lib = library()
    if lib is None:
        return None
    slots = _cpu_int64(slots)[0]
    plen = _cpu_int64(lengths[0])[0] if lengths else \
        torch.full((b,), slots.numel(), dtype=torch.int64)
    if ((slots.numel() and not 0 <= int(slots.min()) <= int(slots.max()) < pk.shape[0])
            or (lengths and not 0 <= int(plen.min()) <= int(plen.max()) <= slots.shape[1])):
        return None  # torch's path says what is wrong
    q, k, v, pk, pv = _unit_stride(q, k, v, pk, pv)
    mask_strides = (0, 0)
    if mask is not None:
        mask = mask.expand(b, 1, m, n)
        if mask.stride(-1) != 1:
            mask = mask.contiguous()
        mask_strides = (mask.stride(0), mask.stride(2))
    out = q.new_empty(b, m, heads, d).transpose(1, 2)
    lse = q.new_empty(b, heads, m)
    strides = (ctypes.c_int64 * 21)(*q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
                                    *mask_strides, *out.stride()[:3], *lse.stride()[:2],
                                    *pk.stride()[:2], *pv.stride()[:2],
                                    slots.stride(0) if slots.dim() == 2 else 0)
    shape = (ctypes.c_int * 6)(b, heads, kv_heads, m, n, d)
    with _profiled():
        rc = lib.minirt_attention(q.data_ptr(), k.data_ptr(), v.data_ptr(),
                                  0 if mask is None else mask.data_ptr(), pk.data_ptr(),
                                  pv.data_ptr(), slots.data_ptr(), plen.data_ptr(),
                                  out.data_ptr(),
                                  lse.data_ptr(), strides, shape, scale, int(causal),
                                  torch.get_num_threads())
    return (out, lse) if rc == 0 else None


def decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, own: torch.Tensor | None,
           scale: float, prefix_k: torch.Tensor | None = None,
           prefix_v: torch.Tensor | None = None, rows: torch.Tensor | None = None,
           sizes: torch.Tensor | None = None,
           lengths: torch.Tensor | None = None) -> torch.Tensor | None:
    """``cascade_decode`` (``minirt/attention.py``) by minirt's kernel: the attention ``[b,
    heads, d]`` of ``q`` ``[b, heads, d]``, one position per row, over the first ``own[r]``
    keys of ``k``, ``v`` ``[b, kv_heads, n, d]`` (``own`` None: all ``n``), after the
    prefix its group holds, if any: prefix ``g`` of ``prefix_k``, ``prefix_v`` ``[G,
    kv_heads, P, d]`` is read by rows ``rows[g, :sizes[g]]`` (``PrefixGroups``' ``index``)
    to its first ``lengths[g]`` positions. None for what it leaves to torch: not fp32 on
    the CPU, head_dim not a multiple of the vector width, a row in two groups or with no
    keys, shapes that do not fit together, or no kernel."""
    b, heads, d = q.shape
    kv_heads, n = k.shape[1], k.shape[2]
    grouped = rows is not None
    tensors = (q, k, v, prefix_k, prefix_v) if grouped else (q, k, v)
    if (q.device.type != "cpu" or any(x.dtype != torch.float32 for x in tensors)
            or heads % kv_heads or k.shape != v.shape or k.shape[0] != b or k.shape[3] != d
            or (own is not None and own.numel() != b)
            or (grouped and (prefix_k.shape != prefix_v.shape or prefix_k.dim() != 4
                             or prefix_k.shape[1] != kv_heads or prefix_k.shape[3] != d
                             or rows.dim() != 2 or not sizes.numel() == lengths.numel()
                             == rows.shape[0] <= prefix_k.shape[0]))):
        return None  # torch's path says what is wrong
    lib = library()
    if lib is None:
        return None
    q, k, v = _unit_stride(q, k, v)
    own = torch.full((b,), n, dtype=torch.int64) if own is None else _cpu_int64(own)[0]
    if grouped:
        prefix_k, prefix_v = _unit_stride(prefix_k, prefix_v)
        rows, sizes, lengths = _cpu_int64(rows, sizes, lengths)
    else:
        prefix_k = prefix_v = k.new_empty(0, kv_heads, 0, d)
        rows = sizes = lengths = _NONE
    out = q.new_empty(b, heads, d)
    strides = (ctypes.c_int64 * 16)(*q.stride()[:2], *k.stride()[:3], *v.stride()[:3],
                                    *prefix_k.stride()[:3], *prefix_v.stride()[:3],
                                    *out.stride()[:2])
    shape = (ctypes.c_int * 8)(b, heads, kv_heads, d, sizes.numel(),
                               rows.shape[1] if grouped else 0, n, prefix_k.shape[2])
    with _profiled():
        rc = lib.minirt_decode(q.data_ptr(), k.data_ptr(), v.data_ptr(), prefix_k.data_ptr(),
                               prefix_v.data_ptr(), out.data_ptr(), own.data_ptr(),
                               rows.data_ptr(), sizes.data_ptr(), lengths.data_ptr(), strides,
                               shape, scale, torch.get_num_threads())
    return out if rc == 0 else None


def _matrix(x: torch.Tensor) -> torch.Tensor | None:
    """``x`` as ``[rows, features]``, fp32 on the CPU with the features contiguous, as the
    layer kernels read it: a view, no copy (None where there is none)."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.stride(-1) != 1:
        return None
    try:
        return x.view(-1, x.shape[-1])
    except RuntimeError:  # leading dimensions that do not collapse into one
        return None


def rms_norm(h: torch.Tensor, weight: torch.Tensor, eps: float,
             delta: torch.Tensor | None = None) -> torch.Tensor | None:
    """transformers' ``LlamaRMSNorm`` of ``h`` ``[..., dim]`` by minirt's kernel, after
    ``h += delta`` where ``delta`` is given (in place: the residual add before the norm);
    None, ``h`` untouched, for what it leaves to torch (not fp32 on the CPU, shapes that
    differ, no kernel)."""
    x, w = _matrix(h), _matrix(weight)
    e = None if delta is None else _matrix(delta)
    lib = library() if x is not None and w is not None else None
    if (lib is None or w.numel() != x.shape[1] or w.shape[0] != 1
            or (delta is not None and (e is None or e.shape != x.shape))):
        return None
    out = torch.empty(h.shape, dtype=h.dtype)
    lib.minirt_rms_norm(x.data_ptr(), 0 if e is None else e.data_ptr(), w.data_ptr(),
                        out.data_ptr(), x.shape[0], x.shape[1], x.stride(0),
                        0 if e is None else e.stride(0), x.shape[1], eps,
                        torch.get_num_threads())
    return out


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """RoPE in place on ``q`` ``[..., heads, d]`` and ``k`` ``[..., kv_heads, d]`` by
    minirt's kernel, with the tables ``[..., 1, d]`` of ``llama._rope_tables`` (one row
    per position): the bits of ``llama._rope``. One call where ``k``'s heads follow
    ``q``'s in memory (the fused q/k/v GEMM's output), two otherwise. False, nothing
    changed, for what it leaves to torch."""
    c, s, d = _matrix(cos), _matrix(sin), q.shape[-1]
    if (c is None or s is None or d % 2 or k.shape[-1] != d or c.shape != s.shape
            or c.shape[1] != d or c.stride(0) != s.stride(0)
            or any(x.device.type != "cpu" or x.dtype != torch.float32 or x.stride(-1) != 1
                   for x in (q, k))):
        return False
    try:
        qv, kv = (x.view(-1, x.shape[-2], d) for x in (q, k))
    except RuntimeError:  # leading dimensions that do not collapse into one
        return False
    lib = library()
    if lib is None or not qv.shape[0] == kv.shape[0] == c.shape[0]:
        return False
    views = [qv, kv]
    if (qv.stride() == kv.stride() and qv.stride(1) == d
            and kv.data_ptr() == qv.data_ptr() + qv.shape[1] * d * qv.element_size()):
        views = [qv.as_strided((qv.shape[0], qv.shape[1] + kv.shape[1], d), qv.stride())]
    for v in views:
        lib.minirt_rope(v.data_ptr(), v.shape[0], v.shape[1], d, v.stride(0), v.stride(1),
                        c.data_ptr(), s.data_ptr(), c.stride(0), torch.get_num_threads())
    return True


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
    """``silu(gate) * up`` by minirt's kernel (``gate``, ``up`` ``[..., dim]``, views of
    the fused gate/up GEMM's output), to within fp32 rounding of torch's; None for what it
    leaves to torch."""
    g, u = _matrix(gate), _matrix(up)
    lib = library() if g is not None and u is not None else None
    if lib is None or g.shape != u.shape:
        return None
    out = gate.new_empty(gate.shape)
    lib.minirt_silu_mul(g.data_ptr(), u.data_ptr(), out.data_ptr(), g.shape[0], g.shape[1],
                        g.stride(0), u.stride(0), g.shape[1], torch.get_num_threads())
    return out


def gemv(x: torch.Tensor, weight: torch.Tensor,
         bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """``F.linear(x, weight, bias)`` for one row (``x`` ``[..., K]`` holding one row, the
    layer's own ``weight`` ``[N, K]``) by minirt's kernel, to within fp32 rounding; None
    for what it leaves to torch: more than one row, not fp32 on the CPU, K not a multiple
    of the vector width, shapes that do not fit, no kernel."""
    if x.numel() != x.shape[-1] or weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        return None
    v, w = _matrix(x), _matrix(weight)
    b = None if bias is None else _matrix(bias)
    lib = library() if v is not None and w is not None else None
    if lib is None or (bias is not None and (b is None or b.numel() != w.shape[0])):
        return None
    y = torch.empty(*x.shape[:-1], w.shape[0])
    rc = lib.minirt_gemv(v.data_ptr(), w.data_ptr(), 0 if b is None else b.data_ptr(),
                         y.data_ptr(), w.shape[0], w.shape[1], w.stride(0),
                         torch.get_num_threads())
    return y if rc == 0 else None
