"""Beyond one device: mesh axes, placement rules, multi-host start-up, memory ledgers.

mesh_axes (layer 0) names the axes; sharding (2) places parameters and KV pages on a
mesh; ledger / ledger_tp (7) count what a model and its pages take per device;
distributed (9) starts jax.distributed.  Imports the model's config and below.
"""
