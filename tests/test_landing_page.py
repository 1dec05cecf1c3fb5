"""The landing page's code (book/index.md): it runs as written and fits the page's column."""

import re
from pathlib import Path

import numpy as np

INDEX = Path(__file__).resolve().parent.parent / "book" / "index.md"


def test_python_blocks_run_and_fit_the_column():
    blocks = re.findall(r"```python\n(.*?)```", INDEX.read_text(), re.S)
    assert blocks
    for block in blocks:
        assert all(len(line) <= 90 for line in block.splitlines()), block
        namespace = {}
        exec(compile(block, str(INDEX), "exec"), namespace)
    np.testing.assert_allclose(namespace["pooled"], [[4, 5, 6, 7], [22, 23, 24, 25]])
