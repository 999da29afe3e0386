"""What a store gives back about its versions: :class:`VersionInfo` (a version without its parameters)
and :class:`Checkpoint` (one read, with them).

Plain values shared by the store's interface (:mod:`._base`) and the modules that build or sort them
(:mod:`._layout`, :mod:`._retention`, :mod:`._history`); this module imports nothing of the store.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from ..params import FlatParams

__all__ = ["Checkpoint", "VersionInfo", "version_id"]


def version_id(version: object) -> str:
    """``version``, if it is a version id (a str); else a :class:`TypeError` naming it."""
    if isinstance(version, str):
        return version
    hint = ""
    if isinstance(version, float) and math.isnan(version):  # (a history row's empty version_id, as pandas has it)
        hint = (
            ": a history row whose merge was committed together with later ones (commit_every other than 1) "
            "has no version_id of its own; the next row that has one holds its merge"
        )
    raise TypeError(
        "version must be a version id (a str, as store.versions() and FitResult.history's version_id give), "
        f"got {version!r} ({type(version).__name__}){hint}"
    )


@dataclass(frozen=True)
class VersionInfo:
    """One committed version, without its parameters.

    Attributes
    ----------
    id : str
        The version id (an Icechunk snapshot id).
    parent : str or None
        The version this one was committed on top of.
    written_at : datetime
        Commit time (UTC).
    message : str
        Commit message.
    metadata : dict
        The metadata given to :meth:`ParamStore.commit`.
    """

    id: str
    parent: str | None
    written_at: datetime
    message: str
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Checkpoint:
    """A version's parameters and metadata, as returned by :meth:`ParamStore.read`."""

    info: VersionInfo
    params: FlatParams

    @property
    def version(self) -> str:
        """The version id."""
        return self.info.id

    @property
    def metadata(self) -> dict[str, Any]:
        """The metadata stored with the version."""
        return self.info.metadata

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The parameters as a ``state_dict`` (views into the flat arrays)."""
        return self.params.state_dict()

    def load_into(self, module: torch.nn.Module) -> torch.nn.Module:
        """Copy the parameters into ``module`` (exact name/shape/dtype match required)."""
        from ..params import load_into

        return load_into(module, self.params)
