"""What pdproxy shows of itself: Prometheus metrics (``/metrics``, and on a port of their own),
tracing settings and the trace id on log lines, and the live dashboard."""
