"""The SLA planner (issue 56): predicts the next interval's load and sizes the prefill and decode capacity that
meets the SLOs. Torch-free, pure logic: what it reads and how it acts live above it."""
