"""The math of the JAX ops, written once: the JAX twin of ``logitless.formulas`` (same
module names, same statements; tests/formula_cases.py holds both to one float64 spec).

    cross_entropy  cross-entropy with label smoothing, class weights and z-loss; the
                   merge of split statistics and the soft-cap the backends share
    log_probs      token log-probabilities and entropy at a temperature
    jsd            distillation: the generalized JSD of two heads' rows, its gradient
    topk_kl        distillation from a teacher's top-k log-probs: every direction and tail
"""
