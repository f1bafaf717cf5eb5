"""Pre-flight and integrity checks (not built yet: see the verify issue)."""
