"""The benchmark: runs under memory caps, its worker process, the report and the frontier pictures."""
