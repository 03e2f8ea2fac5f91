"""Counter-based uniforms: a request's verification randomness as a function of (its seed, its
output position, the uniform's role), never of its batch mates or of what was drawn before.

Scope: the uniform block ``u [batch_size, num_steps, num_columns]`` a verifier consumes
(``base.Verifier.uniform_shape``), computed instead of drawn from a shared generator. Entry
``u[b, s, c] = U(seed_b, position_b, key[s, c])``: ``key`` names the role of the uniform inside
one tree (``Verifier.uniform_keys``: a top-down verifier's "acceptance test of round i at depth
step t", not a column index that moves with the batch's widest node), so the same tree of the
same request at the same output position sees the same uniforms whichever requests share its
step, on every tensor-parallel rank alike.

U is splitmix64 (Steele, Lea, Flood 2014) applied to the three inputs in turn, its top 53 bits
scaled to [0, 1): ``h = mix(mix(mix(seed + g) ^ position) ^ key)``, ``u = (h >> 11) * 2**-53``
(g = the golden-ratio increment). Lossless use needs only that the uniforms of one verification
be independent U[0, 1) draws, which a good 64-bit mixer gives for distinct keys.

Worked example: seeds [7, 7], positions [100, 101], keys [[0, 1]] -> u[0] != u[1] (the
positions differ); u[0] is the same array in any batch that contains request 0 at position 100.
"""

from __future__ import annotations

import zlib

import numpy as np
import torch

__all__ = ["counter_uniforms", "request_seed", "VERIFY_STREAM"]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
VERIFY_STREAM = 0x7E21F  # mixed into seeds derived for unseeded requests (drafting uses its own)


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise on uint64 (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def counter_uniforms(seeds, positions, keys: np.ndarray, device="cpu") -> torch.Tensor:
    """float64 uniforms ``[B, S, C]``: ``u[b, s, c] = U(seeds[b], positions[b], keys[s, c])``.

    ``seeds`` ``[B]`` (any integers, taken mod 2**64), ``positions`` ``[B]``, ``keys`` ``[S, C]``
    int64 (distinct within one verification)."""
    seeds = np.asarray(seeds).astype(np.uint64)
    positions = np.asarray(positions).astype(np.uint64)
    keys = np.asarray(keys).astype(np.uint64)
    with np.errstate(over="ignore"):
        h = _mix(seeds + _GOLDEN)
        h = _mix(h ^ positions)
        h = _mix(h[:, None, None] ^ keys[None])
    u = (h >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))
    return torch.from_numpy(u).to(device)


def request_seed(seed: int | None, req_id: str, engine_seed: int | None) -> int:
    """A request's verification seed: its own ``seed`` when it has one, else one derived from the
    request id and the engine seed (the same on every tensor-parallel rank), mixed with
    ``VERIFY_STREAM`` so that it never equals the stream a draft model samples drafts from."""
    base = int(seed) if seed is not None else zlib.crc32(req_id.encode()) ^ int(engine_seed or 0)
    return int(_mix(np.array([base & 0xFFFFFFFFFFFFFFFF ^ VERIFY_STREAM], np.uint64))[0])
