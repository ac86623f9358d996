"""The handlers, one file per kind of module, each registering its module form and its
functional form (`base.py`: the one registry; what it holds does not depend on the order these
files are imported in). Users declare their own classes with `register_module`."""
from . import (
               broadcast_add,
               channel_norm,
               conv,
               embedding,
               embedding_bag,
               hf_conv1d,
               linear,
               norm,
               repeat,
               sequence_bias,
)
from .base import Handler, Site, Use, handler_for, is_declared, kinds, register_module, unregister_module

KINDS = kinds()

__all__ = ["KINDS", "Handler", "Site", "Use", "broadcast_add", "channel_norm", "conv", "embedding", "embedding_bag",
           "handler_for", "hf_conv1d", "is_declared", "linear", "norm", "register_module", "repeat", "sequence_bias",
           "unregister_module"]
