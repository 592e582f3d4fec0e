"""Spec models and loaders: the files users write."""
from plan3d.specs.cluster import ClusterSpec, NetworkTier, ResolvedTier
from plan3d.specs.gpu import GPUSpec
from plan3d.specs.model import MLASpec, ModelSpec, MoESpec
from plan3d.specs.training import TrainingSpec

__all__ = ["ClusterSpec", "NetworkTier", "ResolvedTier", "GPUSpec", "ModelSpec", "MoESpec", "MLASpec", "TrainingSpec"]
