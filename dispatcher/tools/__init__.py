"""The ops tools behind `python -m dispatcher`: bench, soak, selftest's planner, and the
control client (status, drain, reload). The only part of dispatcher/ that may import
workers/ (bench and soak drive an engine in-process)."""
