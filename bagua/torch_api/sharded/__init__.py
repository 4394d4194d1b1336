"""Sharded replicas: Bagua's algorithms between replicas that FSDP2 shards over the fast links inside each.

``model.with_bagua([optimizer], algorithm, device_mesh=mesh, replicate_dim="replicate")`` on a model
``fully_shard``-ed over ``mesh["shard"]``; see :mod:`bagua.torch_api.sharded.replicas` and docs/fsdp.md.
"""

from bagua.torch_api.sharded.replicas import SUPPORTED, ShardedReplicas

__all__ = ["ShardedReplicas", "SUPPORTED"]
