"""OpenTelemetry traces, torch-free and optional (`pip install pdserve[otel]`): the tracer a process exports
with (setup.py), W3C trace context in and out of HTTP headers (propagation.py), and the GenAI semantic
conventions' attribute names (genai.py). Nothing here is imported on a request's path while tracing is off."""
