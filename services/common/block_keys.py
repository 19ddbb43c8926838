"""Keys of the engine's prefix cache, computed the same way in every process: the engine registers and
looks up its KV blocks by them, and the gateway hashes prompts with them to route each request to the
engine replica that holds its prefix.

`chain_hashes` names full blocks by their whole prefix. `max_hit_blocks` is the compute rule: a prompt's
last token is always computed (its logits give the first new token), so a prefix hit covers at most
`len - 1` tokens, and only whole blocks of them.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes  # SHA-256 digest of a whole prefix, block by block


def chain_hashes(
    tokens: Sequence[int], block_size: int, start: int, parent: BlockHash | None
) -> list[BlockHash]:
    """Hashes of the full blocks of `tokens` from block index `start` on, each chained to the one before
    (`parent` is the hash of block `start - 1`, None at 0), so equal hashes mean equal whole prefixes.

    A hash is SHA-256 of the parent's digest (nothing for the first block) followed by the block's token
    ids as little-endian uint32: the same in every process, and a collision, which would hand one
    request (or tenant) another's KV, is out of practical reach."""
    block = struct.Struct(f"<{block_size}I")
    hashes: list[BlockHash] = []
    for i in range(start, len(tokens) // block_size):
        digest = hashlib.sha256(b"" if parent is None else parent)
        digest.update(block.pack(*tokens[i * block_size : (i + 1) * block_size]))
        parent = digest.digest()
        hashes.append(parent)
    return hashes


def max_hit_blocks(num_tokens: int, block_size: int) -> int:
    """How many leading full blocks of a sequence of `num_tokens` tokens the prefix cache may serve: at
    least one token is left to compute, and it lands in a block of the request's own."""
    return (num_tokens - 1) // block_size
