"""Decode attention over KV rows read in place, on the CPU: a C++ kernel built on first use.

On the torch path a decode step first copies each sequence's K/V rows out of the pool
(``index_select``), then runs torch's flash kernel over the copies: twice the memory traffic,
and the flash kernel, tiled for long query blocks, reads a decode step's few query rows' keys
at a third of the machine's bandwidth. ``row_attention`` reads the rows where they lie instead
(``csrc/row_attention.cpp``): each sequence attends to the rows its row ids name, and decoding
sequences over one shared prefix (a group) read its rows once for all of them, in the same
call, with one softmax over each query's shared and own rows.

The kernel is compiled with ``torch.utils.cpp_extension`` (a C++ compiler and ninja on the
PATH; the build is cached under ``$TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``,
about 30 s the first time, under a second after). ``load()`` builds it; the engine calls it at
start, never inside a request. Where it cannot be built, ``load()`` says why once (a warning)
and returns None, and the engine keeps the torch path.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import shutil
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger("kvstore.kernels")
SOURCE = Path(__file__).parent / "csrc" / "row_attention.cpp"
# instruction sets by torch's own detection of the CPU (not -march=native: a cached build must
# run on any machine that shares the cache directory and reports the same capability). AVX-512
# machines get 256-bit code too: with 64-wide heads it ran a cache-hot step 1.2x faster there
# (each dot product's horizontal sum costs more on 512-bit vectors).
_ISA_FLAGS = {
    "AVX512": ["-mavx2", "-mfma"],
    "AVX2": ["-mavx2", "-mfma"],
}


def capability() -> str:
    """torch's name for the CPU's vector instructions (AVX512, AVX2, DEFAULT, ...)."""
    return str(torch.backends.cpu.get_cpu_capability())


@functools.cache
def load() -> ModuleType | None:
    """The built kernel module (built now if its cache has none), or None where it cannot be
    built (the reason is logged once as a warning)."""
    missing = [tool for tool in ("c++", "ninja") if shutil.which(tool) is None]
    if missing:
        log.warning("the CPU decode kernel is not built (%s not on the PATH): decode attention takes the "
                    "torch path (docs/engine.md)", " and ".join(missing))
        return None
    from torch.utils.cpp_extension import load as build

    isa = capability()
    flags = ["-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", *_ISA_FLAGS.get(isa, [])]
    # one build per torch installation (venvs beside each other never share, nor rebuild in turn)
    torch_id = hashlib.sha256(f"{torch.__version__} {Path(torch.__file__).parent}".encode()).hexdigest()[:12]
    try:
        return build(name=f"kvstore_row_attention_{isa.lower()}_{torch_id}", sources=[str(SOURCE)],
                     extra_cflags=flags, verbose=False)
    except Exception as exc:  # a compiler error, a read-only cache: the torch path still works
        log.warning("the CPU decode kernel did not build (%s): decode attention takes the torch path", exc)
        return None


def row_attention(q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, own_rows: torch.Tensor,
                  own_lens: torch.Tensor, members: torch.Tensor, counts: torch.Tensor, shared_rows: torch.Tensor,
                  shared_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Decode attention of ``q`` ``[S, kv_heads, group, head_dim]`` (one new token per sequence,
    ``group`` query heads per KV head; float32, contiguous) over KV rows read in place.

    Sequence s attends to the shared rows of the item it belongs to, then to its own rows. An
    item is a group of sequences whose contexts begin with the same rows (read once for all of
    them), or a sequence alone (no shared rows). Index tensors are int64 and contiguous; rows
    past a length are never read (pad them with anything).

    Args:
        k_rows, v_rows: one layer's row views ``[R, kv_heads, head_dim]`` (float32, heads
            contiguous, the same row stride), as ``kvstore.engine.attention.row_view`` makes them.
        own_rows, own_lens: ``[S, L]`` row ids and ``[S]`` counts (at least 1) of each
            sequence's own rows.
        members, counts: ``[B, M]`` sequence indices and ``[B]`` counts (at least 1) of each
            item's members; every sequence is in exactly one item.
        shared_rows, shared_lens: ``[B, P]`` row ids and ``[B]`` counts (0 for a sequence alone)
            of each item's shared rows.

    Returns:
        ``[S, kv_heads, group, head_dim]``: softmax(q k^T * scale) v over each sequence's rows.

    Raises:
        RuntimeError: the kernel is not built (call ``load()`` first and check it).
        ValueError: a shape, dtype or stride does not fit, a count, row id or member is out of
            range, or a sequence is in no item or in several.
    """
    module = load()
    if module is None:
        raise RuntimeError("the CPU decode kernel is not built: check kvstore.kernels.cpu_rows.load() first")
    try:
        # named for torch's profiler (a pybind call is not an op it records)
        with torch.profiler.record_function("kvstore::row_attention"):
            out: torch.Tensor = module.row_attention(q, k_rows, v_rows, own_rows, own_lens, members, counts,
                                                     shared_rows, shared_lens, float(scale))
    except RuntimeError as exc:  # the kernel's input checks (TORCH_CHECK): the first line names the problem
        raise ValueError(str(exc).split("\n")[0]) from exc
    return out
