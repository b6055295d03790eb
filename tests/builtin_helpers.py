"""What several tests ask of the built-in model."""
from __future__ import annotations

# Short English and code openings: varied enough that greedy continuations and perplexities differ.
PROMPTS = [
    "The capital of France is", "def add(a, b):", "Water boils at", "The quick brown fox", "In 1969, humans",
    "My favourite recipe for soup", "import numpy as np\n", "The theory of relativity", "Dear hiring manager,",
    "Photosynthesis is the process", "Once upon a time", "The best way to learn a language",
    "SELECT name FROM users WHERE", "The mitochondria is", "A haiku about winter:", "To be or not to be",
    "The largest planet in the solar system", "Machine learning models", "Here is a list of fruits:",
    "The history of Rome",
]
