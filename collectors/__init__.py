"""Collectors: one module per telemetry source (engine files, NVML, eBPF)."""
