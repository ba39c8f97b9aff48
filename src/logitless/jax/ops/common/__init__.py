"""Pieces shared by the JAX ops (never an op's math): the backend contract, the table and
the per-device plan (``contract``: its docstring lists the files a new op or backend
touches), one base class per backend kind with its Config, checks and plan (``xla``,
``triton`` -- also the runtime of the "triton" backends: launches through jax-triton or
Triton's interpreter, the chunked gradient GEMMs --, ``mosaic_gpu``, ``mosaic_tpu``), the
automatic backend choice (``choice``), the input checks (``validate``) and the chunk
loops (``chunks``)."""
