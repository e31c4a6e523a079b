"""Old names kept working for a while after a rename, with a ``FutureWarning`` that names the new one."""
from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any


def warn_renamed(old: str, new: str) -> None:
    warnings.warn(f"`{old}` is renamed `{new}`; the old name will be removed in a future release",
                  FutureWarning, stacklevel=3)


def renamed_module_attributes(module_name: str, renames: dict[str, str], namespace: dict[str, Any]
                              ) -> Callable[[str], Any]:
    """A module ``__getattr__`` (PEP 562) that answers each old name of ``renames`` (old -> new) with the object
    now in ``namespace`` under the new name, warning once per access."""

    def __getattr__(name: str) -> Any:
        if name in renames:
            warn_renamed(f"{module_name}.{name}", f"{module_name}.{renames[name]}")
            return namespace[renames[name]]
        raise AttributeError(f"module {module_name!r} has no attribute {name!r}")

    return __getattr__


def renamed_method(old: str, method: Callable) -> Callable:
    """``method`` under its old name ``old``, warning on each call."""

    @functools.wraps(method)
    def alias(*args: Any, **kwargs: Any) -> Any:
        warn_renamed(old, method.__name__)
        return method(*args, **kwargs)

    alias.__name__ = old
    return alias
