"""Placeholder, replaced below once the privacy modules land."""


def release_ess(ess, bounds, noise_std_rescaled, key, symmetric_blocks):
    raise NotImplementedError


def plan_release(privacy, block_bounds, n, batch_size, iterations):
    raise NotImplementedError
