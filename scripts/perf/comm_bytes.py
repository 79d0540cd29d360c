"""The bytes a collective counts, from the project's one definition (src/dist/comm_bytes.h) through
its C interface in libzb_comm_bytes.so: the tools that count or predict communication (the
benchmark's PyTorch peer, the comm replay) use these, never a copy of the formulas.

The library is looked for in ZB_COMM_BYTES_LIB, then beside these scripts in an installed tree
(<prefix>/lib), then in the source tree's build/src (scripts/build.sh makes it).
"""
import ctypes
import os

_HERE = os.path.dirname(os.path.abspath(__file__))
_CANDIDATES = [
    os.environ.get("ZB_COMM_BYTES_LIB", ""),
    os.path.join(_HERE, "..", "..", "..", "..", "lib", "libzb_comm_bytes.so"),  # <prefix>/share/zeroband-cpp/scripts/perf
    os.path.join(_HERE, "..", "..", "build", "src", "libzb_comm_bytes.so"),      # the source tree
]


def _load():
    for path in _CANDIDATES:
        if path and os.path.exists(path):
            lib = ctypes.CDLL(os.path.abspath(path))
            i64, p64 = ctypes.c_int64, ctypes.POINTER(ctypes.c_int64)
            lib.zb_counted_bytes.argtypes = [ctypes.c_char_p, i64, i64, i64, i64]
            lib.zb_counted_bytes.restype = i64
            lib.zb_all_to_all_counted_bytes.argtypes = [i64, i64, i64, i64, i64, p64, p64]
            lib.zb_all_to_all_counted_bytes.restype = i64
            return lib
    raise SystemExit("comm_bytes: no libzb_comm_bytes.so (build the project: scripts/build.sh, or set "
                     "ZB_COMM_BYTES_LIB); looked in: " + ", ".join(p for p in _CANDIDATES if p))


_lib = None


def counted(kind, W, payload, rank=0, root=0):
    """all_gather (payload: input bytes), reduce_scatter (output bytes), all_reduce, broadcast,
    gather, scatter (tensor bytes) over W ranks, as `rank` counts it."""
    global _lib
    _lib = _lib or _load()
    n = _lib.zb_counted_bytes(kind.encode(), W, rank, root, payload)
    if n < 0:
        raise ValueError(f"comm_bytes: unknown collective {kind}")
    return n


def all_to_all(W, rank, unit_bytes, in_units, out_units, in_splits=None, out_splits=None):
    """all_to_all of in_units units (of unit_bytes each) into out_units; splits per rank, in units
    (None: equal parts)."""
    global _lib
    _lib = _lib or _load()
    arr = lambda s: (ctypes.c_int64 * W)(*s) if s else None  # noqa: E731
    return _lib.zb_all_to_all_counted_bytes(W, rank, unit_bytes, in_units, out_units, arr(in_splits), arr(out_splits))
