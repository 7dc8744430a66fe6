"""The grammar that names boundary functions: a family and one integer parameter, written as two
words (``sine 2``, ``exp 8``), which is what an agent proposes in. Imports nothing heavier than
the standard library, so the rule-based reward function can parse proposals without torch; the
functions themselves are in :mod:`tasks.hc_pinn.boundary`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

POWER_FAMILIES = ("poly", "sine", "dist", "rfun")
SHARPNESS_FAMILIES = ("exp", "tanh")
FAMILIES = POWER_FAMILIES + SHARPNESS_FAMILIES
MAX_POWER = 8
MAX_SHARPNESS = 32

# The forms found in HC-PINN papers and codes: x(1-x) products and their square, sin(pi x)
# products, the exact distance, the R-function distance, and 1-e^{-t} / tanh(t) in time.
COMMON: tuple[str, ...] = ("poly 1", "poly 2", "sine 1", "dist 1", "rfun 1", "exp 1", "tanh 1")

_SPEC_RE = re.compile(r"\b(" + "|".join(FAMILIES) + r")\b(?:\s+(\d{1,3}))?", re.IGNORECASE)


@dataclass(frozen=True, order=True)
class BoundarySpec:
    """A boundary function: a family of :data:`FAMILIES` and its integer parameter."""

    family: str
    param: int = 1

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"unknown boundary family {self.family!r}; known: {list(FAMILIES)}")
        top = MAX_POWER if self.family in POWER_FAMILIES else MAX_SHARPNESS
        if not 1 <= self.param <= top:
            raise ValueError(f"{self.family}: parameter must be in 1..{top}, got {self.param}")

    def __str__(self) -> str:
        return f"{self.family} {self.param}"


def parse_spec(text: str) -> BoundarySpec | None:
    """The first ``family [param]`` in ``text`` (param defaults to 1), or None when there is
    none or its parameter is out of range. Never raises."""
    if not isinstance(text, str) or len(text) > 256:
        return None
    m = _SPEC_RE.search(text)
    if not m:
        return None
    try:
        return BoundarySpec(m.group(1).lower(), int(m.group(2)) if m.group(2) else 1)
    except ValueError:
        return None


def parse_replies(responses: list[str]) -> tuple[list[BoundarySpec], int]:
    """An episode's replies as the verifiers replay them: the valid proposals in order, and
    the number of replies that named no boundary function (format errors)."""
    specs = [parse_spec(text) for text in responses]
    valid = [s for s in specs if s is not None]
    return valid, len(specs) - len(valid)


def grammar() -> list[BoundarySpec]:
    """Every spec the grammar allows."""
    return [BoundarySpec(f, p) for f in POWER_FAMILIES for p in range(1, MAX_POWER + 1)] + \
        [BoundarySpec(f, k) for f in SHARPNESS_FAMILIES for k in range(1, MAX_SHARPNESS + 1)]
