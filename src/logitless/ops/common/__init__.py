"""What every op shares above the formulas and the kernels: backend dispatch
(``dispatch``), autocast as ``F.linear`` (``autocast``), input checks (``validate``) and
the autograd glue of the torch.library custom ops (``autograd``). No op's own code
lives here, and no op imports another op's modules."""
