"""How the work is split: every planning decision of the library, each made in one place.

Planning decides *how* (tiles, chunks, strategy, kernel), never *what*: the math is the
formulas' whichever plan runs, and a plan depends on the shape, dtype, budget, the
device's facts and overrides only (``device``: one ``DeviceFacts`` per device, read
once, which tests and probes build to describe a device they do not have;
``overrides``; ``memo`` keeps each planner's results). What several ops share lives in
this folder, the layer below ``ops/`` (it never imports an op); what one op alone
decides lives beside that op's backends and Config, in ``ops/<op>/``. Paths are under
``src/logitless/``; each name is of its row's file; indented rows are a part of the row
above; lce, llp: linear_cross_entropy, linear_log_probs. docs/design.md ("Planner and
cost model") says why the shipped choices are what they are.

=================================================  ==============================  ==================================
Decision                                           Decided by                      File
=================================================  ==============================  ==================================
**Shared**
default memory budget: 3% of a GPU, else 256 MiB  ``budget_of_total_memory``      options.py
  a torch device's total; a JAX device's total    ``default_memory_budget``       ops/common/validate.py; jax/budget.py
fused linear ops' Triton tiles: forced, tuned,     ``_tiles``                      planning/plans.py
  ROCm, else the CUDA / interpreter tables         ``CUDA_TILES``, ...             planning/tiles.py
tuned tiles (this machine's cache, shipped)        ``tiles_for``                   planning/tuned.py
ROCm: tiles, no TMA, dot precision                 ``tiles``, ``adapt_plan``, ...  planning/rocm.py
what the planners read of a device (one seam)      ``facts`` -> ``DeviceFacts``    planning/device.py
  its planning model: interpreter or GPU class     ``INTERPRETER``, GPU classes    planning/cost_model.py
  multiprocessors the plans assume                 ``num_sms``                     planning/plans.py
forward vocabulary splits (WAVES per SM)           ``wave_blocks_per_split``       planning/plans.py
  16-bit on GPUs: fewer K steps per program        ``forward_blocks_per_split``    planning/tiles.py
floor of a recomputed backward chunk               ``min_chunk_cols``              planning/plans.py
kept columns, chunk width, TF32 W chunks, odd V    ``_triton_plan``                planning/plans.py
  GPU models: the cost model's columns             ``_model_columns``              planning/plans.py
  the interpreter model: greedy columns            ``_greedy_columns``             planning/plans.py
lce / llp strategy: keep, partial, grad-in-fwd     ``lce_strategy``                planning/plans.py
  their predicted times and memory                 ``choose``                      planning/cost_model.py
a forced strategy (``override(strategy=...)``)     ``forced_strategy``             planning/plans.py
one call's plan (forward, backward, chunks)        ``linear_plan``                 planning/plans.py
TF32 route: pre-rounded or in registers            ``tf32_choice``                 planning/plans.py
  whether a plan's launches run pre-rounded        ``runs_prerounded``             triton_lib/launch.py
program order, grouping, persistent dlogits        ``kernel_options``              planning/plans.py
CuTe DSL or Triton forward; CuTe splits            ``forward_plan``                planning/cute.py
PyTorch, lce / llp / linear_jsd: token x vocab     ``torch_plan``                  planning/plans.py
  their bytes per step (lce, llp)                  ``linear_torch_plan``           ops/common/torch_tiles.py
PyTorch rows: cross_entropy, log_probs             ``ce_torch_plan``               planning/logits.py
Triton tiles: cross_entropy, log_probs, jsd        ``ce_triton_plan``              planning/logits.py
row statistics' split: jsd, linear_jsd             ``jsd_stats_plan``              planning/logits.py
PyTorch rows: jsd, linear_jsd                      ``jsd_torch_rows``              planning/logits.py
linear_jsd forward's logit chunk (Triton, Helion)  ``jsd_forward_rows``            planning/logits.py
the backend of ``backend="auto"``                  ``resolve_backend``             ops/common/validate.py
Helion, or the backend in its place                ``fallback_name_of_call``       ops/common/helion_choice.py
**One op, one kernel library**
linear_jsd: tiles, chunks, KL forward splits       ``linear_jsd_plan``             ops/linear_jsd/planning.py
linear_jsd: fused KL forward or chunked            ``jsd_kl_fused``                ops/linear_jsd/planning.py
linear_jsd: recompute, keep or grad-in-forward     ``linear_jsd_strategy``         ops/linear_jsd/planning.py
  their predicted times and memory                 ``choose_jsd``                  ops/linear_jsd/cost_model.py
linear_jsd, PyTorch: weight columns per step       ``_vocab_step``                 ops/linear_jsd/torch_backend.py
truncated linear_log_probs: rows per step          ``thresholds``                  ops/linear_log_probs/truncation.py
linear_topk_kl: the forward's unrolled id slots    ``id_slots``                    ops/linear_topk_kl/triton_backend.py
truncated log-probs: threshold pass splits         ``splits_for``                  triton_lib/log_probs_candidates.py
Helion kernels' configs; their dz chunk            ``pick``; ``vocab_chunk``       helion_lib/{configs,grad_kernels}.py
JAX: xla / triton backends' chunks and tiles       ``xla_plan``, ``triton_plan``   jax/planning.py
=================================================  ==============================  ==================================

Modules here: ``plans`` (the fused linear ops' plans and the pieces linear_jsd builds
on), ``logits`` (plans over whole rows of logits), ``cost_model`` (device classes, kernel
times, the linear ops' strategy choice), ``tiles`` (tables and plan dataclasses,
framework-free: the JAX side shares them), ``device`` (the facts of a device),
``tuned``, ``rocm``, ``cute``, ``overrides``, ``memo``.
"""
