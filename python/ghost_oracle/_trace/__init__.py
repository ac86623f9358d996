"""What both exporters share, framework-neutral (numpy only): the trace format, the `Site` a
capture is handed over as, the self-check against the framework's own gradient, and the writer."""
