"""Kept so that ``hybridflow.controller.mesh`` imports keep working; the mesh lives in :mod:`hybridflow.mesh`.

Torch-only layers (backends, engines, resharding) import :mod:`hybridflow.mesh` directly:
importing anything under ``hybridflow.controller`` runs the package's ``__init__``, which loads Ray.
"""

from hybridflow.mesh import DeviceMesh, MeshCoord, MeshError

__all__ = ["DeviceMesh", "MeshCoord", "MeshError"]
