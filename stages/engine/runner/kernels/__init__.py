"""CPU kernels built at run time for the machine at hand, loaded through ctypes.

Torch has no decode attention that reads a paged KV cache through block tables on CPU (its SDPA
takes dense K/V, and FlexAttention's paged path needs ``torch.compile``), so without one every
decode step gathers every sequence's K/V into a padded copy per layer: at 32 streams and ~170
tokens of context that is ~0.5 GB of copying per step. ``paged_attention.cpp`` reads the blocks
in place instead. ``quant_matmul.cpp`` multiplies by the GGUF's own quantised blocks,
``dequant.cpp`` unpacks one layer of those blocks to dense weights for a prompt chunk's GEMM,
``decode_layers.cpp`` runs a decode step's whole layer stack on those two in one call, and
``argmax.cpp`` is greedy decoding's argmax as one vector scan per row.

The sources are compiled together, once per machine, with the system C++ compiler (``g++ -O3
-march=native``: AVX2, AVX-512 or whatever this CPU has; ``engine.cpu_isa`` picks an older set) into
one library in ``~/.cache/lifecycle-serve/kernels`` (or ``$LIFECYCLE_KERNEL_CACHE``), keyed by the
sources, the compiler, the flags and the CPU's feature flags, so another CPU or a changed source
builds afresh. It is a plain C ABI with no torch headers. ctypes releases the GIL for each call.
Where no compiler is found or the build fails, every loader here returns ``None`` and the engine
keeps its torch paths.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

_DIR = Path(__file__).parent
#: The library's sources, compiled as one shared object.
SOURCES = tuple(_DIR / name for name in ("paged_attention.cpp", "quant_matmul.cpp", "dequant.cpp", "argmax.cpp",
                                              "decode_layers.cpp"))
_FLAGS = ["-O3", "-fopenmp", "-fPIC", "-shared", "-std=c++17", "-fno-math-errno"]
_ABI_VERSION = 2
_lock = threading.Lock()


def cache_dir() -> Path:
    """Where built kernels live."""
    return Path(os.environ.get("LIFECYCLE_KERNEL_CACHE", Path.home() / ".cache" / "lifecycle-serve" / "kernels"))


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def _cpu_key() -> str:
    from stages.engine.runner.quant import cpu_flags

    return " ".join(sorted(cpu_flags()))


#: ``engine.cpu_isa`` -> the feature flags it needs and the ``-march`` it builds with, plus any
#: further ``-m`` flags ("": the compiler's default target, which uses no AVX on x86 and runs on any
#: CPU of the architecture).
ISAS = {
    "auto": ((), "native"),
    "avx512": (("avx512f", "avx512bw", "avx512_vnni", "f16c", "fma"), "native"),
    "avxvnni": (("avx2", "fma", "f16c", "avx_vnni"), "haswell -mavxvnni"),
    "avx2": (("avx2", "fma", "f16c"), "haswell"),
    "generic": ((), ""),
}


def march_for(isa: str) -> str:
    """The ``-march`` value for ``engine.cpu_isa`` ``isa``; ``ValueError`` where this CPU lacks it."""
    from stages.engine.runner.quant import cpu_flags

    if isa not in ISAS:
        raise ValueError(f"cpu_isa must be one of {sorted(ISAS)}, not {isa!r}")
    needs, march = ISAS[isa]
    missing = [f for f in needs if f not in cpu_flags()]
    if missing:
        raise ValueError(f"cpu_isa={isa}: this CPU lacks {', '.join(missing)}")
    return march


def build(sources: Sequence[Path] = SOURCES, march: str = "native") -> Path:
    """Compile ``sources`` into one library for this machine (or find it already built); returns
    its path. ``march`` other than ``native`` builds for an older instruction set (``haswell``: the
    AVX2 paths on an AVX-512 machine; "": the compiler's baseline). Raises ``RuntimeError`` when
    there is no compiler or the build fails."""
    flags = [*(f"-march={march}".split() if march else []), *_FLAGS]
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++) on PATH")
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    texts = [src.read_text() for src in sources]
    key = hashlib.sha256("\0".join([*texts, cxx, version, " ".join(flags), _cpu_key()]).encode())
    out = cache_dir() / f"lifecycle-kernels-{key.hexdigest()[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build into a temp file and rename: several engine replicas (or test processes) may build at once.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cxx, *flags, *map(str, sources), "-o", tmp], capture_output=True, text=True,
                              timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"{cxx} failed building the kernels: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


class PagedDecodeAttention:
    """Decode attention over the paged cache (see ``paged_attention.cpp``)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.lifecycle_paged_decode_attention
        i32, i64, ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [ptr, i64, ptr, ptr, i32, ptr, i32, ptr, i32, i32, i32, i32, i32, ctypes.c_float, ptr, i32]
        fn.restype = None
        self._fn = fn

    def __call__(self, q: Any, k_cache: Any, v_cache: Any, tables: Any, ctx_lens: Any, block_size: int,
                 scale: float, num_threads: int) -> Any:
        """``q`` ``[B, H, D]`` float32 (heads contiguous per sequence), caches ``[slots, KVH, D]``
        float32 or bfloat16, ``tables`` ``[B, W]`` int32, ``ctx_lens`` ``[B]`` int32 -> ``[B, H, D]``."""
        import torch

        b, heads, dim = q.shape
        kv_heads = k_cache.shape[1]
        if q.dtype != torch.float32 or q.stride(2) != 1 or q.stride(1) != dim:
            q = q.float().contiguous()
        if not (k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.dtype == v_cache.dtype):
            raise ValueError("the caches must be contiguous and of one dtype")
        if k_cache.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"cache dtype {k_cache.dtype} is not supported")
        if tables.dtype != torch.int32 or ctx_lens.dtype != torch.int32 or not tables.is_contiguous():
            raise ValueError("tables and ctx_lens must be contiguous int32")
        out = torch.empty((b, heads, dim), dtype=torch.float32)
        self._fn(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                 int(k_cache.dtype == torch.bfloat16), tables.data_ptr(), tables.shape[1], ctx_lens.data_ptr(),
                 b, block_size, heads, kv_heads, dim, scale, out.data_ptr(), num_threads)
        return out


class QuantMatmul:
    """``x @ W.T`` on GGUF Q4_1 / Q8_0 blocks with int8 activations (see ``quant_matmul.cpp``)."""

    #: The dot-product path the build uses, by :attr:`isa` value.
    ISA_NAMES = {3: "avx512-vnni", 2: "avx-vnni", 1: "avx2", 0: "scalar"}

    def __init__(self, lib: ctypes.CDLL) -> None:
        i32, i64, ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
        self._q4 = lib.lifecycle_q4_1_matmul
        self._q4.argtypes = [ptr, i32, i64, ptr, ptr, ptr, i64, ptr, i64, i32]
        self._q4.restype = None
        self._q8 = lib.lifecycle_q8_0_matmul
        self._q8.argtypes = [ptr, i32, i64, ptr, ptr, i64, ptr, i64, i32]
        self._q8.restype = None
        self._quant = lib.lifecycle_quantize_q8
        self._quant.argtypes = [ptr, i32, i64, ptr, ptr]
        self._quant.restype = None
        self._unpack_q4 = lib.lifecycle_unpack_q4_1
        self._unpack_q4.argtypes = [ptr, ptr, ptr, i64, i64, ptr, i32, i32]
        self._unpack_q4.restype = None
        self._unpack_q8 = lib.lifecycle_unpack_q8_0
        self._unpack_q8.argtypes = [ptr, ptr, i64, i64, ptr, i32, i32]
        self._unpack_q8.restype = None
        self.isa = int(lib.lifecycle_quant_isa())
        #: The built library's path: its name hashes the sources, compiler, flags and CPU.
        self.library = str(lib._name)

    @property
    def isa_name(self) -> str:
        return self.ISA_NAMES.get(self.isa, str(self.isa))

    def q4_1(self, x: Any, wq: Any, wd: Any, wm: Any, n: int, threads: int) -> Any:
        """``x`` ``[rows, K]`` float32 contiguous; ``wq``, ``wd``, ``wm`` in the tile layout of
        :func:`stages.engine.runner.quant.pack_q4_1` -> ``[rows, n]`` float32."""
        import torch

        rows, k = x.shape
        out = torch.empty((rows, n), dtype=torch.float32)
        self._q4(x.data_ptr(), rows, k, wq.data_ptr(), wd.data_ptr(), wm.data_ptr(), n, out.data_ptr(), n, threads)
        return out

    def q8_0(self, x: Any, wq: Any, wd: Any, n: int, threads: int) -> Any:
        """The same for Q8_0 (:func:`stages.engine.runner.quant.pack_q8_0`)."""
        import torch

        rows, k = x.shape
        out = torch.empty((rows, n), dtype=torch.float32)
        self._q8(x.data_ptr(), rows, k, wq.data_ptr(), wd.data_ptr(), n, out.data_ptr(), n, threads)
        return out

    def unpack(self, wq: Any, wd: Any, wm: Any | None, out: Any, threads: int) -> Any:
        """The dense weights of Q4_1 (``wm`` given) or Q8_0 blocks in the tile layout into ``out``
        ``[n, K]``, contiguous bfloat16 or float32 (see ``dequant.cpp``); returns ``out``."""
        import torch

        n, k = out.shape
        if not out.is_contiguous() or out.dtype not in (torch.bfloat16, torch.float32) or \
                wq.shape[1] * 32 != k or wq.shape[0] * 16 < n:
            raise ValueError(f"unpack: out {tuple(out.shape)} {out.dtype} does not fit blocks {tuple(wq.shape)}")
        bf16 = int(out.dtype == torch.bfloat16)
        if wm is not None:
            self._unpack_q4(wq.data_ptr(), wd.data_ptr(), wm.data_ptr(), n, k, out.data_ptr(), bf16, threads)
        else:
            self._unpack_q8(wq.data_ptr(), wd.data_ptr(), n, k, out.data_ptr(), bf16, threads)
        return out

    def quantize_activations(self, x: Any) -> tuple[Any, Any]:
        """The kernel's own int8 rounding of ``x`` ``[rows, K]``: ``(qx int8 [rows, K], dx [rows, K/32])``."""
        import torch

        x = x.float().contiguous()
        rows, k = x.shape
        qx = torch.empty((rows, k), dtype=torch.int8)
        dx = torch.empty((rows, k // 32), dtype=torch.float32)
        self._quant(x.data_ptr(), rows, k, qx.data_ptr(), dx.data_ptr())
        return qx, dx


class RowArgmax:
    """``x.argmax(dim=-1)`` for a float32 ``[rows, n]`` CPU tensor (see ``argmax.cpp``); the same
    indices as torch's, ties and NaNs included."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.lifecycle_argmax_rows
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [ptr, i64, i64, i64, ptr]
        fn.restype = None
        self._fn = fn
        #: Whether this build scans with AVX-512 (a scalar build is no faster than torch).
        self.vectorized = bool(lib.lifecycle_argmax_vectorized())

    def __call__(self, x: Any) -> Any:
        import torch

        if x.dtype != torch.float32 or x.dim() != 2 or x.device.type != "cpu" or x.stride(1) != 1:
            return x.argmax(dim=-1)
        out = torch.empty(x.shape[0], dtype=torch.int64)
        self._fn(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr())
        return out


def library(march: str = "native") -> ctypes.CDLL:
    """The library built for ``march``, loaded (:func:`_load_kernel` keeps what it wraps)."""
    with _lock:
        lib = ctypes.CDLL(str(build(SOURCES, march)))
    if lib.lifecycle_kernels_abi_version() != _ABI_VERSION:
        raise RuntimeError("kernel ABI version mismatch")
    return lib


class DecodeLayers:
    """Every decoder layer of a decode-only step in one call (see ``decode_layers.cpp``)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.lifecycle_decode_layers
        i32, ptr, f32 = ctypes.c_int32, ctypes.c_void_p, ctypes.c_float
        fn.argtypes = [ptr, i32, i32, i32, i32, i32, i32, i32, ptr, f32, ptr, ptr, ptr, i32, ptr, i32, ptr, i32,
                       f32, i32]
        fn.restype = None
        self._fn = fn
        #: Addresses per layer in the table :meth:`__call__` takes.
        self.nptr = int(lib.lifecycle_decode_layers_nptr())

    def __call__(self, x: Any, dims: tuple[int, int, int, int, int], table: Any, eps: float, cos: Any, sin: Any,
                 slots: Any, cache_bf16: bool, tables: Any, ctx_lens: Any, block_size: int, scale: float,
                 threads: int) -> None:
        """Run the layers over ``x`` ``[rows, hidden]`` float32 in place. ``dims`` is (hidden, heads,
        kv_heads, head_dim, intermediate); ``table`` ``[layers, nptr]`` int64 addresses; ``cos``,
        ``sin`` ``[rows, head_dim]`` float32; ``slots`` ``[rows]`` int64; ``tables``/``ctx_lens`` as
        :class:`PagedDecodeAttention`. The caller keeps every addressed buffer alive and checks
        dtypes and shapes (:class:`stages.engine.runner.models.llama.FusedDecode`)."""
        hidden, heads, kv_heads, head_dim, inter = dims
        self._fn(x.data_ptr(), x.shape[0], hidden, heads, kv_heads, head_dim, inter, table.shape[0], table.data_ptr(),
                 eps, cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), int(cache_bf16), tables.data_ptr(),
                 tables.shape[1], ctx_lens.data_ptr(), block_size, scale, threads)


@cache
def _load_kernel(wrapper: Any, fallback: str, isa: str) -> Any:
    """``wrapper`` around the library built for ``isa`` (``engine.cpu_isa``), or ``None`` (logged,
    with what is used instead) where it cannot be built or loaded here. A CPU that lacks ``isa``
    raises ``ValueError``."""
    march = march_for(isa)
    try:
        return wrapper(library(march))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        logger.warning("%s unavailable, using %s: %s", wrapper.__name__, fallback, exc)
        return None


def paged_attention(isa: str = "auto") -> PagedDecodeAttention | None:
    """The built kernel, or ``None`` where it cannot be built here (then use the SDPA path)."""
    result: PagedDecodeAttention | None = _load_kernel(PagedDecodeAttention, "gather + SDPA", isa)
    return result


def row_argmax(isa: str = "auto") -> RowArgmax | None:
    """The built argmax where it is vectorised here, or ``None`` (then torch's argmax)."""
    result: RowArgmax | None = _load_kernel(RowArgmax, "torch.argmax", isa)
    return result if result is not None and result.vectorized else None


def quant_matmul(isa: str = "auto") -> QuantMatmul | None:
    """The built block-quantised matmul, or ``None`` where it cannot be built here."""
    result: QuantMatmul | None = _load_kernel(QuantMatmul, "torch's int4/int8 kernels", isa)
    return result


def decode_layers(isa: str = "auto") -> DecodeLayers | None:
    """The built whole-layer decode step, or ``None`` where it cannot be built here."""
    result: DecodeLayers | None = _load_kernel(DecodeLayers, "the per-op decode path", isa)
    return result
