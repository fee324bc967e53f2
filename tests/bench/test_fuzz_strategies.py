"""The live fuzz's frame strategy: its own size arithmetic never raises on the text it draws."""

from __future__ import annotations

import pytest

from chunkline.bench.fuzz.strategies import _declared_count, _itemsize


@pytest.mark.parametrize("dtype", ["(,)f4", "(", "1,(", "", "zz", b"f4", 3, None])
def test_a_dtype_numpy_cannot_read_counts_four_bytes(dtype: object) -> None:
    assert _itemsize(dtype) == 4


def test_a_dtype_numpy_reads_counts_its_own_bytes() -> None:
    assert _itemsize("<f8") == 8
    assert _itemsize("u2") == 2


@pytest.mark.parametrize(("shape", "count"), [([2, 3], 6), ([], 1), ([2, 3.0], 0), ("2x3", 0), (None, 0)])
def test_only_a_shape_of_ints_declares_elements(shape: object, count: int) -> None:
    assert _declared_count(shape) == count
