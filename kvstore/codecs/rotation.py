"""The fixed rotation ``int4-rot`` applies along head_dim (docs/storage-format.md, "Codecs").

A block outlives the process that wrote it, so the matrix is a function of ``head_dim`` alone,
built the same way on every machine, and never stored:

- ``head_dim`` a power of two: the Sylvester Hadamard matrix divided by ``sqrt(head_dim)``
  (``H_1 = [1]``, ``H_2k = [[H_k, H_k], [H_k, -H_k]]``), symmetric and its own inverse;
- any other ``head_dim``: a random orthogonal matrix from a fixed seed. ``head_dim**2``
  normals come from splitmix64 (seed ``ROTATION_SEED``) through Box-Muller, fill a float64
  matrix ``A`` row by row, and the rotation is the ``Q`` of ``A = QR`` with each column's sign
  chosen so that ``R``'s diagonal is positive (the one such ``Q``).

A head row ``x`` is stored rotated as ``x @ M`` and read back as ``y @ M.T``. The entries are
float32 (the float64 matrix rounded once); a library that rounds a float64 differently changes
an entry by at most one float32 step, which moves a decoded value by about 1e-7 of its row.
"""

from __future__ import annotations

import functools
import math

import torch

ROTATION_SEED = 0x4B564342  # b"KVCB", the encoded blocks' magic, as a big-endian u32
_MASK = (1 << 64) - 1


def rotation(head_dim: int) -> torch.Tensor:
    """The float32 ``[head_dim, head_dim]`` orthogonal matrix ``M`` of ``head_dim`` (CPU, shared:
    do not write to it)."""
    if head_dim < 1:
        raise ValueError(f"head_dim must be >= 1, got {head_dim}")
    return _rotation(head_dim)


def rotation_name(head_dim: int) -> str:
    """Which construction ``rotation(head_dim)`` uses: "hadamard" or "random-orthogonal"."""
    return "hadamard" if head_dim & (head_dim - 1) == 0 else "random-orthogonal"


@functools.lru_cache(maxsize=16)
def _rotation(head_dim: int) -> torch.Tensor:
    matrix = _hadamard(head_dim) if rotation_name(head_dim) == "hadamard" else _random_orthogonal(head_dim)
    return matrix.to(torch.float32)


def _hadamard(n: int) -> torch.Tensor:
    h = torch.ones((1, 1), dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)], dim=0)
    return h / math.sqrt(n)


def _random_orthogonal(n: int) -> torch.Tensor:
    a = torch.tensor(_normals(n * n, ROTATION_SEED), dtype=torch.float64).view(n, n)
    q, r = torch.linalg.qr(a)
    return q * torch.where(torch.diagonal(r) < 0, -1.0, 1.0)


def splitmix64(seed: int, count: int) -> list[int]:
    """The first ``count`` outputs of splitmix64 seeded with ``seed`` (u64 each)."""
    state = seed & _MASK
    out = []
    for _ in range(count):
        state = (state + 0x9E3779B97F4A7C15) & _MASK
        z = ((state ^ (state >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
        out.append(z ^ (z >> 31))
    return out


def _normals(count: int, seed: int) -> list[float]:
    """``count`` standard normals: Box-Muller over splitmix64's outputs taken two at a time,
    ``u1 = ((a >> 11) + 1) / 2**53`` in (0, 1] and ``u2 = (b >> 11) / 2**53``, giving
    ``r cos(2 pi u2)`` then ``r sin(2 pi u2)`` with ``r = sqrt(-2 ln u1)``."""
    words = splitmix64(seed, count + count % 2)
    out: list[float] = []
    for a, b in zip(words[0::2], words[1::2], strict=True):
        u1 = ((a >> 11) + 1) / 2.0**53
        u2 = (b >> 11) / 2.0**53
        radius = math.sqrt(-2.0 * math.log(u1))
        out += [radius * math.cos(2.0 * math.pi * u2), radius * math.sin(2.0 * math.pi * u2)]
    return out[:count]
