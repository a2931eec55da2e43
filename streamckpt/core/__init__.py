"""Pure data and geometry every layer shares: regions, the manifest, targets, dtypes, values, checksums.

No I/O and no ranks: nothing here imports ``storage``, ``formats``, ``plan``, ``loading``,
``saving``, ``comm``, ``cuda`` or ``torch.distributed`` (DTensor's types are only inspected).
"""
