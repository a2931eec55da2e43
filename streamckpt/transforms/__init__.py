"""Transforms on load: rename / fuse / fuse_qkv / split / split_qkv / transpose / cast / drop.

A checkpoint rarely names or shapes its tensors the way the model does. Rules apply in
order to a *view* of the checkpoint (name -> shape, dtype); the state_dict is matched
against the final view. Every view tensor is kept as a list of *pieces*: rectangles of
the view tensor, each an affine image (offset shift + dimension permutation) of a box of
one source tensor. Concatenation and splits shift pieces, ``fuse_qkv`` reorders row
blocks, transpose permutes them. Mapping a target box back to the checkpoint is then
plain box arithmetic (:meth:`View.map_box`): nothing is materialized, so a transformed
load still reads only the bytes its targets need. Pure package: the only I/O is reading
a YAML rules file through fsspec in :meth:`Transforms.from_yaml`, or a preset shipped in
``presets/`` (``transforms="hf_llama_to_vllm"``; :func:`presets` lists them).

Modules, one idea each: ``patterns`` (``{i}`` / ``*`` name patterns), ``rules`` (parsing
and validating one rule, dtype names), ``pieces`` (the piece algebra), ``ops`` (what each
rule kind does to pieces), ``states`` (optimizer-state names that follow a parameter),
``apply`` (one rule applied to the view), ``inverse`` (undoing applied rules), ``view``
(the final view and target-box -> source-box mapping), ``ruleset`` (``Transforms``,
YAML loading, ``as_transforms``). See docs/TRANSFORMS.md for the rule reference.
"""

from __future__ import annotations

from .rules import parse_dtype
from .ruleset import Transforms, as_transforms, presets
from .states import STATE_COMPONENT
from .view import SourceSegment, SourceSpec, View, ViewTensor, identity_view

__all__ = [
    "SourceSegment",
    "ViewTensor",
    "View",
    "Transforms",
    "as_transforms",
    "presets",
    "identity_view",
    "parse_dtype",
    "STATE_COMPONENT",
]
