"""fuse-shared converter: fuse MoE shared experts into trailing routed-expert slots, offline."""

__version__ = "0.1.0"
