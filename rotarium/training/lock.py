"""The lock a training run holds on its run folder: :class:`rotarium.utils.lock.FolderLock`, which ``rotarium
prepare`` takes on its OUT too."""
from rotarium.utils.lock import LOCK
from rotarium.utils.lock import FolderLock as RunLock
from rotarium.utils.lock import FolderLocked as RunLocked

__all__ = ["LOCK", "RunLock", "RunLocked"]
