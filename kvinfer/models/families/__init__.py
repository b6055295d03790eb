"""Families whose differences would bend the one decoder: each file holds the family's block and weight names."""
