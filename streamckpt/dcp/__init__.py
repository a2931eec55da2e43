"""``torch.distributed.checkpoint`` plug-ins: DCP plans, streamckpt moves the bytes.

Switch an existing DCP job to object storage with one argument::

    import torch.distributed.checkpoint as dcp
    from streamckpt.dcp import StorageReader, StorageWriter

    opts = {"endpoint_url": "http://127.0.0.1:9000", "key": "...", "secret": "..."}  # fsspec options
    dcp.save(state, storage_writer=StorageWriter("s3://bucket/ckpt/step-100", storage_options=opts))
    dcp.async_save(state, storage_writer=StorageWriter(uri, storage_options=opts))  # also works
    dcp.load(state, storage_reader=StorageReader("s3://bucket/ckpt/step-100", storage_options=opts))

``StorageWriter`` leaves a native streamckpt checkpoint (data files with a CRC32C per
chunk, ``manifest.json`` written last by the coordinator once every rank's upload
succeeded: a failed save commits nothing and an overwritten checkpoint stays valid until
the new manifest replaces it). It reads back with ``StorageReader`` and also with
``sc.load`` / ``sc.load_state`` / ``streamckpt verify`` (checksummed, resharded to any
layout). DCP's own ``FileSystemReader`` cannot read it: the layout is streamckpt's, not
``.metadata`` + ``.distcp``, so that no pickle is ever stored and every byte is checksummed.
DCP keeps its job: its planner deduplicates replicas and runs the plan's collectives.

``StorageReader`` reads a native, Hugging Face or DCP checkpoint at ``uri`` and fetches
only the byte ranges of each ``ReadItem``'s sub-box (checksummed checkpoints: the chunks
covering it, verified), under streamckpt's retries and timeouts. Of a DCP checkpoint it
locates one item exactly and predicts where the others' tensor bytes start, as ``sc.load``
does (``formats.dcpguess``); the predicted item heads it relies on are read with the data
(adjacent ranges of a file are one request) and compared before any item is handed to DCP
(``formats.speculation``); on a difference it locates the items exactly and reads again.
Non-tensor values are
answered as ``torch.save``'d bytes, DCP's format for ``BYTE_IO`` items.
``reader.stats`` counts what the last load fetched (``bytes_read``, ``bytes_needed``,
``requests``). Errors are ``streamckpt.CheckpointError`` subclasses; DCP wraps them in a
``CheckpointException`` whose ``failures`` hold the original per rank.
"""

from .common import GAP_BYTES, MEMORY_BUDGET
from .reader import ReadStats, StorageReader
from .writer import StorageWriter

__all__ = ["StorageReader", "StorageWriter", "ReadStats", "MEMORY_BUDGET", "GAP_BYTES"]
