"""What the server tells about itself: Prometheus metrics, Triton's statistics, OpenTelemetry traces and log lines.
It sees the core's values only; the layers above report into it."""
