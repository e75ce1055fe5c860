"""cuBLASLt matmuls with an algorithm chosen by timing (CUDA only, through ctypes).

torch.mm runs the one kernel cuBLAS's heuristic picks. cuBLASLt's heuristic returns a ranked list,
and for some shapes a later entry is clearly faster: the LM head's weight-gradient updates
(gW[V, H] += grad_c^T @ x_c, K = a chunk of tokens) get a cooperative 320x128 kernel from torch.mm
that reads the C operand (all of gW) after its main loop; a ping-pong 128x160 kernel further down
the list overlaps one warp group's epilogue with the other's main loop, about 10% less time an update
on an H100 (BENCHMARKS.md, "LM head: the weight-gradient updates through cuBLASLt").

`mm(a, b, out, accumulate)` is torch.mm / addmm_ with that choice made once per signature (shapes,
strides, dtypes, address alignment, device). The first call that overwrites `out` tunes: its old
contents are not needed, so it times the candidates and addmm_ accumulating into `out` (the case that
reads C, which the choice is for), in turn on the real operands, keeps the fastest when it beats
addmm_ by a clear margin, and then overwrites `out` with it. An accumulating call never tunes (it
must add exactly once); until its signature has been tuned it runs addmm_. At most _MAX_SIGNATURES
are tuned in a process (each tune waits on the GPU); later ones run torch.mm. Elsewhere (CPU, ROCm,
fp32, another device than the current one, CUDA graph capture, deterministic algorithms,
names.CUBLASLT=0) it is torch.mm / addmm_. Not tried on ROCm: hipBLASLt has the same heuristic API and
could take the same path.

Operands are row-major terms: out[m, n] = a[m, k] @ b[k, n] (+ out), where a and b may be transposed
views of contiguous tensors. cuBLASLt is column-major, so the call computes out^T = b^T @ a^T, with
b's memory as its A and a's as its B.
"""
from __future__ import annotations

import ctypes
import functools
import os
import statistics

import torch

from core import names

_COMPUTE_32F = 68
_R_32F, _R_16F, _R_16BF = 0, 2, 14
_DTYPES = {torch.bfloat16: _R_16BF, torch.float16: _R_16F, torch.float32: _R_32F}
_OP_N, _OP_T = 0, 1
_DESC_TRANSA, _DESC_TRANSB = 3, 4
_PREF_MAX_WORKSPACE_BYTES = 1
_PREF_MIN_ALIGNMENT = (5, 6, 7, 8)  # of A, B, C and D, in bytes
# cublasLtMatmulAlgoConfigAttributes_t: what an algorithm is, for naming it
_CONFIG_FIELDS = (("algo", 0, ctypes.c_int32), ("tile", 1, ctypes.c_uint32), ("splitk", 2, ctypes.c_uint32),
                  ("reduction", 3, ctypes.c_uint32), ("swizzle", 4, ctypes.c_uint32),
                  ("custom", 5, ctypes.c_uint32), ("stages", 6, ctypes.c_uint32),
                  ("inner", 7, ctypes.c_uint16), ("cluster", 8, ctypes.c_uint16))
# The workspace a candidate may ask for (the non-split-K kernels ask for a few bytes); one per device and stream.
WORKSPACE_BYTES = 4 << 20
# A candidate replaces torch.mm only when it is this much faster (timing noise on a shared clock is a few %).
MARGIN = 0.97
_TUNE_ROUNDS = 3
_MAX_SIGNATURES = 8
_REDUCTION_IN_COMPUTE_TYPE = 2  # cublasLtReductionScheme_t: split-K parts summed in fp32
_ENABLED = os.environ.get(names.CUBLASLT, "1") != "0"
_TUNABLE_DTYPES = (torch.bfloat16, torch.float16)


class LtError(RuntimeError):
    pass


class _Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _Heuristic(ctypes.Structure):
    _fields_ = [("algo", _Algo), ("workspace", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


@functools.cache
def available() -> bool:
    if not torch.cuda.is_available() or torch.version.hip:
        return False
    try:
        _lib()
    except (OSError, AttributeError, LtError):  # AttributeError: a cuBLASLt without one of the symbols
        return False
    return True


@functools.cache
def _lib():
    torch.cuda.current_blas_handle()  # loads cuBLAS, and with it the cuBLASLt torch was built with
    path = None
    with open("/proc/self/maps") as maps:
        for line in maps:
            if "libcublasLt.so" in line:
                path = line.split()[-1]
                break
    lib = ctypes.CDLL(path or "libcublasLt.so")
    vp, i32, u64, i64, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_int64, ctypes.c_size_t
    sigs = {
        "cublasLtCreate": [ctypes.POINTER(vp)],
        "cublasLtMatmulDescCreate": [ctypes.POINTER(vp), i32, i32],
        "cublasLtMatmulDescSetAttribute": [vp, i32, vp, sz],
        "cublasLtMatrixLayoutCreate": [ctypes.POINTER(vp), i32, u64, u64, i64],
        "cublasLtMatmulPreferenceCreate": [ctypes.POINTER(vp)],
        "cublasLtMatmulPreferenceSetAttribute": [vp, i32, vp, sz],
        "cublasLtMatmulAlgoGetHeuristic": [vp, vp, vp, vp, vp, vp, vp, i32, ctypes.POINTER(_Heuristic),
                                           ctypes.POINTER(i32)],
        "cublasLtMatmul": [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, ctypes.POINTER(_Algo), vp, sz, vp],
        "cublasLtMatmulAlgoConfigGetAttribute": [ctypes.POINTER(_Algo), i32, vp, sz, ctypes.POINTER(sz)],
        "cublasLtMatmulPreferenceDestroy": [vp],
        "cublasLtMatmulDescDestroy": [vp],
        "cublasLtMatrixLayoutDestroy": [vp],
    }
    for name, args in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, i32
    return lib


def _check(status: int, what: str) -> None:
    if status != 0:
        raise LtError(f"cuBLASLt {what} failed with status {status}")


def _set_attribute(setter, obj, attr: int, value) -> None:
    """One descriptor or preference attribute, `value` a ctypes scalar of the attribute's C type."""
    _check(setter(obj, attr, ctypes.byref(value), ctypes.sizeof(value)), f"attribute {attr}")


@functools.cache
def _handle(device_index: int) -> ctypes.c_void_p:
    h = ctypes.c_void_p()
    _check(_lib().cublasLtCreate(ctypes.byref(h)), "create")
    return h


@functools.cache
def _workspace(device_index: int, stream: int) -> torch.Tensor:
    return torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=f"cuda:{device_index}")


def _alignment(t: torch.Tensor) -> int:
    """The largest power of two (up to 256) t's address is a multiple of: the heuristic assumes 256
    unless told, and a kernel chosen for aligned operands refuses less aligned ones."""
    p = t.data_ptr()
    return 256 if p == 0 else min(256, p & -p)


def _operand(t: torch.Tensor):
    """(rows, cols, ld, op) of t^T in column-major terms."""
    r, c = t.shape
    if t.stride(1) == 1:            # row-major [r, c] is column-major [c, r]: t^T as is
        return c, r, t.stride(0), _OP_N
    if t.stride(0) == 1:            # a transposed view: column-major [r, c], transpose it
        return r, c, t.stride(1), _OP_T
    raise LtError(f"cuBLASLt operand needs a unit stride, got strides {t.stride()}")


def column_major(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> dict:
    """The cuBLASLt problem for out = a @ b in row-major terms: out^T = b^T @ a^T. Its A is b's memory,
    its B is a's, its D is out's; each as (rows, cols, ld) with the op that turns it into the factor."""
    if out.stride(1) != 1:
        raise LtError("cuBLASLt output must be row-major")
    return {"A": _operand(b), "B": _operand(a), "D": (out.shape[1], out.shape[0], out.stride(0)),
            "m": out.shape[1], "n": out.shape[0], "k": a.shape[1]}


class Matmul:
    """out[m, n] = a @ b (+ beta * out) for one signature: its candidates, and a call with any of them."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor):
        lib = _lib()
        problem = column_major(a, b, out)
        self.device = out.device.index if out.device.index is not None else torch.cuda.current_device()
        self.alignments = (_alignment(b), _alignment(a), _alignment(out), _alignment(out))  # A, B, C, D
        self.desc = ctypes.c_void_p()
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), _COMPUTE_32F, _R_32F), "desc")
        (ra, ca, lda, opa), (rb, cb, ldb, opb), (rd, cd, ldd) = problem["A"], problem["B"], problem["D"]
        for attr, op in ((_DESC_TRANSA, opa), (_DESC_TRANSB, opb)):
            _set_attribute(lib.cublasLtMatmulDescSetAttribute, self.desc, attr, ctypes.c_int32(op))
        self.layouts = []
        for dtype, rows, cols, ld in ((b.dtype, ra, ca, lda), (a.dtype, rb, cb, ldb),
                                      (out.dtype, rd, cd, ldd)):
            lay = ctypes.c_void_p()
            _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(lay), _DTYPES[dtype], rows, cols, ld), "layout")
            self.layouts.append(lay)

    def candidates(self, count: int = 32) -> list[_Heuristic]:
        """The heuristic's ranked algorithms that fit the workspace (its first is what cuBLASLt would run)."""
        lib = _lib()
        pref = ctypes.c_void_p()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "preference")
        set_pref = lib.cublasLtMatmulPreferenceSetAttribute
        _set_attribute(set_pref, pref, _PREF_MAX_WORKSPACE_BYTES, ctypes.c_uint64(WORKSPACE_BYTES))
        for attr, align in zip(_PREF_MIN_ALIGNMENT, self.alignments):
            _set_attribute(set_pref, pref, attr, ctypes.c_uint32(align))
        results = (_Heuristic * count)()
        found = ctypes.c_int(0)
        la, lb, lc = self.layouts
        try:
            _check(lib.cublasLtMatmulAlgoGetHeuristic(_handle(self.device), self.desc, la, lb, lc, lc, pref, count,
                                                      results, ctypes.byref(found)), "heuristic")
        finally:
            lib.cublasLtMatmulPreferenceDestroy(pref)
        return [results[i] for i in range(found.value) if results[i].state == 0]

    def __del__(self):
        try:
            lib = _lib()
            for lay in getattr(self, "layouts", ()):
                lib.cublasLtMatrixLayoutDestroy(lay)
            if getattr(self, "desc", None):
                lib.cublasLtMatmulDescDestroy(self.desc)
        except Exception:  # noqa: BLE001 - at interpreter exit the library may be gone already
            pass

    def __call__(self, a, b, out, algo: _Heuristic, beta: float = 0.0) -> None:
        alpha_v, beta_v = ctypes.c_float(1.0), ctypes.c_float(beta)
        la, lb, lc = self.layouts
        stream = torch.cuda.current_stream(out.device).cuda_stream
        _check(_lib().cublasLtMatmul(_handle(self.device), self.desc, ctypes.byref(alpha_v), b.data_ptr(), la,
                                     a.data_ptr(), lb, ctypes.byref(beta_v), out.data_ptr(), lc, out.data_ptr(),
                                     lc, ctypes.byref(algo.algo), _workspace(self.device, stream).data_ptr(),
                                     WORKSPACE_BYTES, ctypes.c_void_p(stream)), "matmul")


def signature(a, b, out) -> tuple:
    """What a choice is made for: each operand's shape, strides, dtype and address alignment, and the device."""
    return (*((tuple(t.shape), tuple(t.stride()), t.dtype, _alignment(t)) for t in (a, b, out)), out.device)


def describe(h: _Heuristic) -> dict:
    """An algorithm's configuration (cuBLASLt's own ids) and workspace, for reports."""
    lib, out = _lib(), {}
    for name, attr, ctype in _CONFIG_FIELDS:
        v, written = ctype(0), ctypes.c_size_t(0)
        if lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(h.algo), attr, ctypes.byref(v),
                                                    ctypes.sizeof(v), ctypes.byref(written)) == 0:
            out[name] = int(v.value)
    out["workspace"] = int(h.workspace)
    out["waves"] = round(float(h.waves), 2)
    return out


# signature -> (Matmul, algorithm) or None (torch.mm won)
_choices: dict[tuple, tuple | None] = {}


def mm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, accumulate: bool = False) -> None:
    """out = a @ b, or out += a @ b with accumulate, through the algorithm tuned for this signature."""
    key = signature(a, b, out) if _tunable(a, b, out) else None
    choice = _choices.get(key)
    if key is not None and key not in _choices and not accumulate and len(_choices) < _MAX_SIGNATURES:
        _choices[key] = _tune(a, b, out)        # which leaves out = a @ b
        return
    if choice is not None:
        plan, algo = choice
        try:
            plan(a, b, out, algo, 1.0 if accumulate else 0.0)
            return
        except LtError:                         # refused at launch: this signature stays on torch.mm
            _choices[key] = None
    out.addmm_(a, b) if accumulate else torch.mm(a, b, out=out)


def choices() -> dict[str, dict | None]:
    """What was chosen so far: "a @ b -> out" shapes and dtype -> the algorithm's configuration, or None
    for torch.mm."""
    def name(key):
        (a, _, dtype, _), (b, *_), (o, *_), _ = key
        return f"{a[0]}x{a[1]} @ {b[0]}x{b[1]} -> {o[0]}x{o[1]} {str(dtype).removeprefix('torch.')}"
    return {name(k): None if v is None else describe(v[1]) for k, v in _choices.items()}


def _tunable(a, b, out) -> bool:
    return (_ENABLED and out.is_cuda and out.dtype in _TUNABLE_DTYPES and a.dtype == b.dtype == out.dtype
            and out.dim() == 2 and out.stride(1) == 1 and out.get_device() == torch.cuda.current_device()
            and not torch.cuda.is_current_stream_capturing() and not torch.are_deterministic_algorithms_enabled()
            and available())


def _reduces_like_torch(algo: _Heuristic, dtype: torch.dtype) -> bool:
    """False for a split-K candidate that sums its parts in bf16/fp16 where torch.mm is told not to."""
    matmul = torch.backends.cuda.matmul
    allowed = (matmul.allow_bf16_reduced_precision_reduction if dtype == torch.bfloat16
               else matmul.allow_fp16_reduced_precision_reduction)
    if allowed:
        return True
    config = describe(algo)
    return config.get("splitk", 1) <= 1 or config.get("reduction") == _REDUCTION_IN_COMPUTE_TYPE


def _tune(a, b, out):
    """Time addmm_ and each candidate accumulating into out (its contents are about to be overwritten),
    `_TUNE_ROUNDS` times in turn; the fastest candidate if it beats addmm_ by MARGIN. Leaves out = a @ b."""
    try:
        plan = Matmul(a, b, out)
        candidates = [c for c in plan.candidates(16) if _reduces_like_torch(c, out.dtype)]
    except LtError:
        return None
    torch.mm(a, b, out=out)                     # finite values to accumulate onto
    algos = [None]                              # None: torch's addmm_
    for algo in candidates:
        try:
            plan(a, b, out, algo, 1.0)
        except LtError:                         # a candidate the library refuses for these pointers
            continue
        algos.append(algo)

    def run(algo, beta: float = 1.0):
        if algo is None:
            out.addmm_(a, b) if beta else torch.mm(a, b, out=out)
        else:
            plan(a, b, out, algo, beta)

    times = [[] for _ in algos]
    for _ in range(_TUNE_ROUNDS):
        for i, algo in enumerate(algos):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run(algo)
            end.record()
            end.synchronize()
            times[i].append(start.elapsed_time(end))
    median = [statistics.median(t) for t in times]
    best = min(range(len(algos)), key=median.__getitem__)
    chosen = algos[best] if median[best] <= MARGIN * median[0] else None
    run(chosen, beta=0.0)                       # out holds the chosen algorithm's product
    return None if chosen is None else (plan, chosen)
