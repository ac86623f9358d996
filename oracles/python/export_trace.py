#!/usr/bin/env python3
"""The trace exporter for the scripts in this folder: `from export_trace import export_trace`.

The exporter itself lives in the Python package, `python/ghost_oracle/_export.py`
(`ghost_oracle.torch.export_trace`). This file loads that one copy, so the scripts here need
neither a built nor an installed package: the repository's file is used when it is there (the
same commit as these scripts), else the installed package's (`pip install ./python`). Importing
this module gives the exporter module itself, so `export_trace.TraceExportError`, its helpers
and monkeypatching them work as before.

    from export_trace import export_trace
    export_trace(model, per_example_loss, input_ids, "trace.safetensors",
                 claimed_norms=my_clipper_norms, max_grad_norm=1.0, clipper="my-clipper")

See python/ghost_oracle/_export.py for what is modelled and checked.
"""
import importlib.util
import os
import sys

_SOURCE = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python",
                                        "ghost_oracle", "_export.py"))

if os.path.exists(_SOURCE):
    _spec = importlib.util.spec_from_file_location(__name__, _SOURCE)
    _module = importlib.util.module_from_spec(_spec)
    sys.modules[__name__] = _module
    _spec.loader.exec_module(_module)
else:  # this file copied out of the repository: the installed package's exporter
    try:
        import ghost_oracle._export as _module
    except ImportError as e:
        raise ImportError(
            "export_trace: the exporter is python/ghost_oracle/_export.py in the ghost-oracle repository; "
            "install the package (`pip install ./python`) or run this from a checkout") from e
    sys.modules[__name__] = _module
