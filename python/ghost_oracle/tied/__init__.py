"""Exact ghost clipping for tied parameters, as an Opacus plug-in (`make_private`).

This package imports only torch, opacus and the standard library: it is the code under test
when the rest of ghost-oracle judges it, and shares nothing with the judge."""
from .engine import make_private
from .plugin import (
    TiedDPLoss,
    TiedGhostClipping,
    TiedGradSampleHooks,
    TiedGradSampleModule,
)

__all__ = ["TiedDPLoss", "TiedGhostClipping", "TiedGradSampleHooks", "TiedGradSampleModule", "make_private"]
