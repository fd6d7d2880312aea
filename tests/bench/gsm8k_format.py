"""GSM8K-format records written by the tests themselves, so tests run in a clone without the third-party data."""

from __future__ import annotations

import json
import pathlib


def write_gsm8k_format(path: pathlib.Path) -> pathlib.Path:
    """5 shots + 5 questions in GSM8K's JSONL layout (answer ends in "#### <final>") at `path` (the gate's mechanism
    is under test, not the model's maths)."""
    rows = [{"question": f"Tom has {a} apples and buys {b} more. How many apples does he have?",
             "answer": f"He has {a} + {b} = {a + b} apples.\n#### {a + b}"} for a, b in
            [(2, 3), (4, 1), (7, 2), (5, 5), (3, 6), (1, 1), (8, 1), (2, 2), (6, 3), (4, 4)]]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
