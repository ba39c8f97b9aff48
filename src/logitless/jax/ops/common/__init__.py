"""Pieces shared by the JAX ops (never an op's math): the automatic backend choice
(``choice``) and the runtime of the "triton" backends (``triton``: platform checks,
launches through jax-triton or Triton's interpreter, the chunked gradient GEMMs)."""
