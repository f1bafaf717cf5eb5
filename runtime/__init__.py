"""The colibri runtime (not built yet: see the runtime issue)."""
