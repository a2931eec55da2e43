"""A run's checkpoints: the manager, its listing (``index``), retention, deletion and
garbage collection. ``streamckpt.CheckpointManager`` binds the manager to the public calls."""

from .deletion import delete_checkpoint
from .manager import Calls, Manager, Restored
from .retention import Policy

__all__ = ["Calls", "Manager", "Policy", "Restored", "delete_checkpoint"]
