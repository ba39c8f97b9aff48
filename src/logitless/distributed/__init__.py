"""Vocabulary-parallel (tensor-parallel) glue shared by every fused op.

Large models split the LM head over the vocabulary: rank r of a process group holds a
contiguous block of rows W_r (V_r, H) of the full weight W (V, H) (blocks in the group's
rank order; sizes may differ, even be 0), while the hidden states x (N, H) and the
targets are the same on every rank (Megatron's column-parallel head, torchtitan's
``ColwiseParallel`` with ``loss_parallel``). Every statistic our ops reduce a row of
logits to is a statistic over a set of columns, so each rank computes it over its own
columns with the single-GPU backends, and a few collectives of O(tokens) floats merge
them into the statistics of the full row:

    lse      from each rank's (local lse): one MAX, then a SUM of exp(lse_r - M)
             (``formulas.common.merge_splits`` with one part per rank)
    sums     plain sums over columns (the target logit, sum_c w_c z_c): added by the SUM
    means    expectations under the rank's own softmax, E_r[f] = sum_c p^r_c f_c (an
             entropy term sum_c p_c z_c, a KL term): the SUM adds exp(lse_r - M) E_r[f]
    maxes    maxima over columns (the argmax's value): packed with the lse's MAX

Two collectives per forward (one MAX, one packed SUM), whatever the op; a third only
for what the merged statistics are needed first (the argmax's index: a MIN; the
mixture sums of the generalized JSD: a SUM). The backward needs the merged statistics
only: each rank turns its own columns into dz with the backends' kernels, which gives
its rows of dW and db exactly, and a partial sum of dx = dz W, all-reduced in fp32 (or
returned partial, for frameworks that reduce it themselves). No weight, logit or
(tokens x vocab) buffer is ever communicated.

    layout    the process group by name (what custom ops take), each rank's rows, and
              ``VocabShard``: this rank's classes, local targets, padding rows
    merge     the collectives above (``merge_shards``, ``merge_argmax``, ``all_reduce_``;
              ``merge_online`` for online (max, sum, entropy-term) statistics)
    api       the public functions' side: ``process_group=``, DTensor inputs (``dtensor``),
              a padded vocabulary (``vocab_size=``) -> a ``VocabParallelOptions``

How an op gets ``process_group=`` (linear_cross_entropy, linear_jsd, linear_log_probs do this):
    1. its public function calls ``api.prepare(...)`` per LM head and passes the
       ``VocabParallelOptions`` fields to its custom ops (``opts.args()``);
    2. its forward op, when ``tp_group`` is set: ``shard = layout.vocab_shard(...)``;
       runs its backend on ``shard.real_rows(weight)``, ``shard.local_target(target)``
       and ``shard.class_slice(class_weight)``; merges with ``merge.merge_shards`` and
       computes the loss from the merged statistics with the GLOBAL ``shard.vocab_size``;
    3. its backward op: coefficients from the merged statistics, the backend's backward
       on the local rows with ``dx_acc=True``, then ``merge.all_reduce_(dx)`` (unless
       ``partial_dx``) and ``shard.pad_rows(dw)``. The same number of collectives on
       every rank, in the same order (plan chunks with ``shard.max_rows``, not the local
       row count, when collectives run per chunk).
"""

from .layout import VocabShard, vocab_shard
from .merge import Merged, all_reduce_, gather_rows, merge_argmax, merge_online, merge_shards, sum_in_rank_order

__all__ = ["VocabShard", "vocab_shard", "Merged", "merge_shards", "merge_argmax", "merge_online", "all_reduce_",
           "gather_rows", "sum_in_rank_order"]
