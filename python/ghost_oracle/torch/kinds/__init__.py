"""The module handlers, one file per kind of module, each registering its handlers by exact
type; users declare their own classes with `register_module`."""
# Imported in the order `KINDS` lists the declarable kinds.
from . import linear  # noqa: F401, I001
from . import hf_conv1d  # noqa: F401
from . import embedding  # noqa: F401
from . import norm  # noqa: F401
from . import channel_norm  # noqa: F401
from . import conv  # noqa: F401
from . import embedding_bag  # noqa: F401
from . import sequence_bias  # noqa: F401
from .base import Handler, Use, handler_for, is_declared, kinds, register_module, unregister_module

KINDS = kinds()

__all__ = ["KINDS", "Handler", "Use", "handler_for", "is_declared", "register_module", "unregister_module"]
