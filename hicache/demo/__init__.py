"""`hicache demo`, the main job: a sidecar and a synthetic engine replaying a chat trace.

The driver is `demo.run` (`run_demo`); this package file imports nothing, so the CLI's parser
can read the trace's options (`demo.trace`) without importing torch.
"""
