"""The codec tests' shared pieces: a strategy for every supported array, and the reason a payload
is refused for."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from chunkline.client.wire.codec import CodecLimits, decode
from chunkline.client.wire.errors import CodecError, CodecErrorReason

SUPPORTED = ["?", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f2", "f4", "f8"]


def array_strategy() -> st.SearchStrategy[np.ndarray]:
    """Arrays of every supported dtype, in both byte orders, of 0 to 5 dimensions."""
    dtypes = st.sampled_from(SUPPORTED).flatmap(
        lambda code: st.sampled_from([np.dtype(code), np.dtype(code).newbyteorder(">")])
    )
    return dtypes.flatmap(lambda dt: hnp.arrays(dt, hnp.array_shapes(min_dims=0, max_dims=5, min_side=0, max_side=6)))


def refusal_reason(payload: bytes, limits: CodecLimits | None = None) -> CodecErrorReason:
    """The reason ``decode`` refuses ``payload`` for (fails the test if it is accepted)."""
    with pytest.raises(CodecError) as info:
        decode(payload, limits or CodecLimits())
    return info.value.reason
