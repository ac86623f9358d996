"""The exporter's one error type."""


class TraceExportError(ValueError):
    """The model cannot be traced faithfully: a parameter without a site, a site whose factors
    do not rebuild autograd's gradient, a module used in a way the exporter does not model, a
    model that mixes examples."""
