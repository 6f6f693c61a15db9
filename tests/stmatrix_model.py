"""stmatrix as the tests that check its callers model it (tests/test_sm90_gradient_store.py, test_sm90_dq_staging.py).

`stmatrix.sync.aligned.m8n8.x4.shared.b16`: four 8 x 8 matrices of 16-bit values. Lane 8 m + r gives the shared
address of row r of matrix m; row r of matrix m is lane 4 r + c's register m, c < 4, at bytes 4 c .. 4 c + 3 of that
row. A register here is a list of the tags of what it holds: two 16-bit values (low half first) or one 32-bit one.
"""

from __future__ import annotations


def evaluate(expression: str, **names) -> int:
    """A kernel's C integer expression, quoted from its source, with `names` bound (C's division of non-negative
    integers is Python's //)."""
    return eval(expression.replace(" / ", " // "), {}, names)


def store_matrices(buffer: dict[int, object], addresses: dict[int, int], registers: dict[int, list[list[object]]]) -> None:
    """Writes one warp's stmatrix.x4 into `buffer` (byte offset -> tag), from each lane's row address and registers."""
    for matrix in range(4):
        for r in range(8):
            base = addresses[8 * matrix + r]
            for c in range(4):
                parts = registers[4 * r + c][matrix]
                width = 4 // len(parts)  # bytes of each part: 2 for a pair of 16-bit values, 4 for one fp32
                for j, tag in enumerate(parts):
                    buffer[base + 4 * c + width * j] = tag
