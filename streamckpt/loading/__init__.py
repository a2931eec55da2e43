"""Executing a load on one rank: agree on the manifest, plan, fetch, verify, exchange, scatter.

``loader.run_load`` is what ``sc.load`` calls. This layer may use every lower one (``core``,
``plan``, ``storage``, ``formats``, ``cuda``, ``comm``) but never ``saving`` nor the wiring above it.
"""
