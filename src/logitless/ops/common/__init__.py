"""What every op shares above the formulas and the kernels: the backend contract and the
custom-op glue written once against it (``contract``, ``autograd``), input checks and
which backend runs a call (``validate``), autocast as ``F.linear`` (``autocast``). No op's own code
lives here, and no op imports another op's modules."""
