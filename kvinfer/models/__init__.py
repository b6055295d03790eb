"""The one decoder and the per-family weight-name maps."""
