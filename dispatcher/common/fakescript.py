"""The fixed text the fake engine generates (workers/fake_engine.py, the plumbing tests'
stand-in for a model), shared with the soak, which checks what a fake-engine server
answered against it without importing the workers."""
SCRIPT = "The quick brown fox jumps over the lazy dog; café, naïve, 東京. ".encode()
