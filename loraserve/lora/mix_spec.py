"""A request's `merged_adapters` object, checked field by field: which adapters a mix takes, with what
weights and strategy (merge.py computes it). Imports no torch: the scheduler side reads it too."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass

from loraserve.errors import InvalidRequestError

STRATEGIES = ("linear", "cat", "ties", "dare_linear", "dare_ties", "magnitude_prune")
SIGN_METHODS = ("total", "frequency")
FIELD = "merged_adapters"


@dataclass(frozen=True)
class MixSpec:
    """A validated `merged_adapters` object."""

    ids: tuple[str, ...]
    weights: tuple[float, ...]
    merge_strategy: str = "linear"
    density: float = 1.0
    majority_sign_method: str = "total"

    @classmethod
    def parse(cls, value: object, max_parts: int) -> MixSpec:
        """From a request's JSON; InvalidRequestError names the sub-field at fault."""
        if not isinstance(value, dict):
            raise InvalidRequestError(FIELD, "must be an object with ids and weights")
        unknown = sorted(set(value) - {"ids", "weights", "merge_strategy", "density", "majority_sign_method"})
        if unknown:
            raise InvalidRequestError(f"{FIELD}.{unknown[0]}", "is not a field of merged_adapters")
        ids, weights = value.get("ids"), value.get("weights")
        if not isinstance(ids, list) or not ids or not all(isinstance(i, str) and i for i in ids):
            raise InvalidRequestError(f"{FIELD}.ids", "must be a non-empty list of adapter names")
        if len(ids) > max_parts:
            limit = f"at most {max_parts} (--max-mix-parts)"
            raise InvalidRequestError(f"{FIELD}.ids", f"names {len(ids)} adapters; {limit}")
        if len(set(ids)) != len(ids):
            raise InvalidRequestError(f"{FIELD}.ids", "names an adapter twice")
        if not isinstance(weights, list) or len(weights) != len(ids):
            raise InvalidRequestError(f"{FIELD}.weights", f"must be a list of {len(ids)} numbers, one per id")
        if not all(_is_number(w) and math.isfinite(w) for w in weights):
            raise InvalidRequestError(f"{FIELD}.weights", "must hold finite numbers")
        strategy = value.get("merge_strategy", "linear")
        if strategy not in STRATEGIES:
            raise InvalidRequestError(f"{FIELD}.merge_strategy", f"must be one of {', '.join(STRATEGIES)}")
        density = value.get("density", 1.0)
        if not (_is_number(density) and 0 < density <= 1):
            raise InvalidRequestError(f"{FIELD}.density", "must be a number in (0, 1]")
        sign_method = value.get("majority_sign_method", "total")
        if sign_method not in SIGN_METHODS:
            raise InvalidRequestError(f"{FIELD}.majority_sign_method", f"must be one of {', '.join(SIGN_METHODS)}")
        return cls(tuple(ids), tuple(float(w) for w in weights), strategy, float(density), sign_method)

    def content_hash(self, part_hashes: list[str]) -> str:
        """The mix's identity: the spec and its parts' content hashes (never their names' current meaning)."""
        spec = {
            "weights": self.weights, "merge_strategy": self.merge_strategy, "density": self.density,
            "majority_sign_method": self.majority_sign_method, "parts": part_hashes,
        }  # fmt: skip
        return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def mix_seed(sha256: str) -> int:
    """The DARE masks' seed of the mix with this content hash."""
    return int(sha256[:15], 16)
