"""Reference of cross_entropy: the plain definition through torch's own F.cross_entropy
(``ops.common.reference``): (loss, lse, correct) in float64, or in the logits' dtype
("plain torch in the same dtype", the tests' yardstick). Test sizes only.
"""

from logitless.ops.common.reference import cross_entropy_reference

__all__ = ["cross_entropy_reference"]
