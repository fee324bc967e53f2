"""The observation checks' finiteness test: the same answer as numpy's on every float array, small
(checked in Python) or large (checked with numpy), and NaN or infinity refused by
validate_observation on both sides of the size line."""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from chunkline.policies.base import (
    SMALL_FINITE_CHECK,
    ArraySpec,
    ObservationError,
    PolicySpec,
    all_finite,
    validate_observation,
)

_WIDTHS: dict[type[np.floating[Any]], Literal[16, 32, 64]] = {np.float16: 16, np.float32: 32, np.float64: 64}


@st.composite
def float_arrays(draw: st.DrawFn) -> np.ndarray:
    dtype = draw(st.sampled_from(list(_WIDTHS)))
    # Shapes around the size line: empty, small, just over it, and a few dimensions.
    shape = draw(st.one_of(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5),
                           st.sampled_from([(SMALL_FINITE_CHECK,), (SMALL_FINITE_CHECK + 1,), (8, 9)])))
    elements = st.floats(allow_nan=True, allow_infinity=True, width=_WIDTHS[dtype])
    arr = draw(hnp.arrays(dtype, shape, elements=elements))
    if draw(st.booleans()):  # a view that is not contiguous
        arr = arr.T
    return arr


@settings(max_examples=400, deadline=None)
@given(float_arrays())
def test_all_finite_answers_as_numpy_does(arr: np.ndarray) -> None:
    assert all_finite(arr) == bool(np.isfinite(arr).all())


@pytest.mark.parametrize("size", [14, SMALL_FINITE_CHECK, SMALL_FINITE_CHECK + 1, 4096])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_float_field_holding_nan_or_infinity_is_refused_whatever_its_size(size: int, bad: float) -> None:
    spec = PolicySpec({"state": ArraySpec((size,), "float32")}, action_dim=2, horizon=4, dt=0.1)
    ok = np.linspace(-3e38, 3e38, size, dtype=np.float32)  # large finite values are not refused
    assert validate_observation(spec, {"state": ok})["state"] is ok
    for at in (0, size // 2, size - 1):
        state = ok.copy()
        state[at] = bad
        with pytest.raises(ObservationError, match="NaN or infinity"):
            validate_observation(spec, {"state": state})
