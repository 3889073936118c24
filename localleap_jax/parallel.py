"""The earlier home of pmap data parallelism, kept so its name keeps working: see `localleap_jax.dist.pmap`."""

from localleap_jax.dist.pmap import generate_parallel

__all__ = ["generate_parallel"]
