"""Building blocks of the decoder: norms, positions, MLPs, attention."""
