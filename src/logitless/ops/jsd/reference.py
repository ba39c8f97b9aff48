"""Reference of jsd: the plain definition with torch's own functions (``F.log_softmax``,
``F.kl_div``, ``F.cross_entropy``; ``ops.common.reference``), in float64 or in the
inputs' dtype. Test sizes only.
"""

from logitless.ops.common.reference import jsd_reference

__all__ = ["jsd_reference"]
