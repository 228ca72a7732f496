"""ArviZ output for both ArviZ lines: 0.x (``InferenceData``, Python 3.11) and 1.x (``DataTree``, 3.12+).

ArviZ 0.x takes the groups as keyword arguments (``from_dict(posterior=..., log_likelihood=...)``);
1.x takes one dict of groups (``from_dict({"posterior": ...})``). Draws carry a leading chain axis.
"""

from __future__ import annotations


def from_groups(groups: dict):
    """``{"posterior": {name: array[chain, draw, ...]}, ...}`` -> ArviZ data of the installed version."""
    import arviz as az

    groups = {name: group for name, group in groups.items() if group}
    major = int(str(az.__version__).split(".")[0])
    return az.from_dict(groups) if major >= 1 else az.from_dict(**groups)
