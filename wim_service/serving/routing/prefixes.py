"""The prompt blocks of a plain request as the engine's prefix cache keys them: hashes of its
full token blocks, each chained to the ones before it, salted with the tenant's cache salt.

The router keeps, per replica, the blocks of the plain prompts it sent there
(`Ledger.prefixes`), so that the placement policy can send a repeated long prefix back
to the replica that holds it. Salted as the engine's cache is: one tenant's prompt never
matches another's, whatever their tokens.
"""

from __future__ import annotations

import hashlib


def prompt_blocks(prompt_ids: list[int], block_size: int, salt: str) -> tuple[int, ...]:
    """Chained hashes of `prompt_ids`' full blocks of `block_size` tokens (a partial last
    block is never cached by the engine, so it is never matched either)."""
    hashes = []
    previous = salt.encode()
    for start in range(0, len(prompt_ids) - block_size + 1, block_size):
        block = prompt_ids[start : start + block_size]
        digest = hashlib.blake2b(previous, digest_size=8)
        digest.update(b",".join(str(token).encode() for token in block))
        previous = digest.digest()
        hashes.append(int.from_bytes(previous, "big"))
    return tuple(hashes)
