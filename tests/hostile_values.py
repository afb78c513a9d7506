"""Hypothesis strategies for what a hostile client can put in a field: any JSON value, and worse."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

# Values at the edges the engine must not choke on: int64 and float32 limits, huge, tiny, signed zero.
EDGES = st.sampled_from(
    [2**63 - 1, 2**63, 2**64, -(2**63), -(2**63) - 1, 10**20, -(10**20), 10**400, 1e308, -1e308, 3.5e38,
     5e-324, 1e-40, -0.0, 0, -1, 1, 2, 49152, 49153, float("nan"), float("inf"), float("-inf")]
)  # fmt: skip
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats()
    | st.text(max_size=30)
    | EDGES
)
JSON_VALUES: st.SearchStrategy[Any] = st.recursive(
    SCALARS,
    lambda children: st.lists(children, max_size=6) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
LONG_LISTS = st.lists(
    st.integers(min_value=-(2**65), max_value=2**65) | st.text(max_size=3), min_size=50, max_size=3000
)
# Structured-output requests with hostile insides: response_format's and structured_outputs' shapes, any schema.
RESPONSE_FORMATS = st.fixed_dictionaries(
    {"type": st.sampled_from(["json_object", "json_schema", "text"]),
     "json_schema": st.fixed_dictionaries({"name": st.text(max_size=5), "schema": JSON_VALUES})}
)  # fmt: skip
STRUCTURED_OUTPUTS = st.dictionaries(st.sampled_from(["json", "regex", "choice", "json_object"]), JSON_VALUES)
STRUCTURED = RESPONSE_FORMATS | STRUCTURED_OUTPUTS
HOSTILE = JSON_VALUES | LONG_LISTS | EDGES | STRUCTURED


def hostile_fields(names: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    """One to four of `names`, each with a hostile value."""
    return st.dictionaries(st.sampled_from(names), HOSTILE, min_size=1, max_size=4)
