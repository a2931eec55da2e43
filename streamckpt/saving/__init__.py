"""Executing a save on one rank: who writes what, staging, uploads with checksums, the commit.

``saver.run_save`` and ``asyncsave.start_save`` are what ``sc.save``/``sc.async_save`` call.
It may use ``core``, ``storage``, ``cuda`` and ``comm``, never ``plan``, ``loading`` nor the wiring above.
"""
