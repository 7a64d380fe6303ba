"""kvstore's C++ CPU kernels (``csrc/``): one extension module, built on first use.

Two kinds of kernel live in it: decode attention over KV rows read in place (``cpu_rows``,
``csrc/row_attention.cpp``) and the codecs' decode (int8, fp8, int4; ``csrc/dequantize.cpp``).
The module is compiled with
``torch.utils.cpp_extension`` (a C++ compiler and ninja on the PATH; the build is cached under
``$TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``, about 40 s the first time,
under a second after). ``load()`` builds it: the engine calls it at start and a store with a
quantizing codec when it opens (``Codec.prepare``), never inside a request. Where it cannot be built,
``load()`` says why once (a warning) and returns None, and every caller keeps its torch path.
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
SOURCES = sorted((Path(__file__).parent / "csrc").glob("*.cpp"))
# instruction sets by torch's own detection of the CPU (not -march=native: a cached build must
# run on any machine that shares the cache directory and reports the same capability). AVX-512
# machines get 256-bit code too: with 64-wide heads it ran a cache-hot decode step 1.2x faster
# there (each dot product's horizontal sum costs more on 512-bit vectors). Every AVX2 CPU has
# F16C (float16 conversions).
_ISA_FLAGS = {
    "AVX512": ["-mavx2", "-mfma", "-mf16c"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
}


def capability() -> str:
    """torch's name for the CPU's vector instructions (AVX512, AVX2, DEFAULT, ...)."""
    return str(torch.backends.cpu.get_cpu_capability())


@functools.cache
def load() -> ModuleType | None:
    """The built module (built now if its cache has none), or None where it cannot be built
    (the reason is logged once as a warning)."""
    missing = [tool for tool in ("c++", "ninja") if shutil.which(tool) is None]
    if missing:
        log.warning("kvstore's CPU kernels are not built (%s not on the PATH): decode attention and the codecs' "
                    "decode take the torch path (docs/kernels.md)", " and ".join(missing))
        return None
    from torch.utils.cpp_extension import load as build

    isa = capability()
    flags = ["-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", *_ISA_FLAGS.get(isa, [])]
    # one build per torch installation and source text (venvs beside each other never share,
    # nor rebuild in turn; an upgraded kvstore never loads a stale build)
    digest = hashlib.sha256(f"{torch.__version__} {Path(torch.__file__).parent}".encode())
    for source in SOURCES:
        digest.update(source.read_bytes())
    try:
        return build(name=f"kvstore_cpu_{isa.lower()}_{digest.hexdigest()[:12]}",
                     sources=[str(s) for s in SOURCES], extra_cflags=flags, verbose=False)
    except Exception as exc:  # a compiler error, a read-only cache: the torch paths still work
        log.warning("kvstore's CPU kernels did not build (%s): decode attention and the codecs' decode take "
                    "the torch path", exc)
        return None


def loaded() -> ModuleType | None:
    """The module if ``load()`` has already built or found it; never builds (for hot paths)."""
    return load() if load.cache_info().currsize else None
