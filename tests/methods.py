"""Method lists for the test matrices, taken from the part registries (a new part joins them itself)."""

from pipeline.kv.allocation import ALLOCATIONS
from pipeline.kv.config import method_name, method_names
from pipeline.kv.scorers import SCORERS
from pipeline.kv.selection import SELECTIONS

ALL_METHODS = method_names()  # none + every scorer x allocation x selection
COMPRESSING = [m for m in ALL_METHODS if m != "none"]


def one_method_per_part() -> list[str]:
    """A method for every scorer, every allocation and every selection (the others at their defaults)."""
    methods = [method_name(s) for s in SCORERS]
    methods += [method_name("snapkv", allocation=a) for a in ALLOCATIONS]
    methods += [method_name("snapkv", selection=s) for s in SELECTIONS]
    methods += [method_name("snapkv", allocation=a, selection="criticalkv") for a in ALLOCATIONS]
    return list(dict.fromkeys(methods))
