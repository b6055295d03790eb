"""The extractive workload of `kvinfer bench spec`: 8 fixed prompts that ask to repeat, correct or edit a passage."""
from __future__ import annotations

_PASSAGES = [
    ("The lighthouse stood on a rocky point at the edge of the harbour. Every evening the keeper climbed the "
     "ninety steps to the lamp room, cleaned the glass, trimmed the wick and lit the lamp. Ships coming home "
     "through the fog looked for its light, and the keeper kept a log of every vessel that passed."),
    ("def moving_average(values, window):\n    if window <= 0:\n        raise ValueError('window must be "
     "positive')\n    out = []\n    total = 0.0\n    for i, v in enumerate(values):\n        total += v\n"
     "        if i >= window:\n            total -= values[i - window]\n        if i >= window - 1:\n"
     "            out.append(total / window)\n    return out\n"),
    ("Photosynthesis is the process by which green plants use sunlight to turn water and carbon dioxide into "
     "glucose and oxygen. It takes place mainly in the leaves, inside small structures called chloroplasts, "
     "which contain the green pigment chlorophyll."),
    ("Dear Ms. Patel, thank you for your letter of 3 March. We have checked your account and found that the "
     "payment of 120 pounds was taken twice by mistake. The second payment will be refunded to your card "
     "within five working days. We are sorry for the trouble this has caused."),
]

_TYPOS = ("The comittee met on tuesday to discus the new budjet. After a long debait, the members agred to "
          "increse funding for the libary and to repare the old bridge befor the winter.")

_LIST = ("Shopping list: two loaves of bread, a dozen eggs, one litre of milk, a bag of apples, three onions, "
         "a block of cheese, a jar of honey and a packet of rice.")

EXTRACTIVE_PROMPTS: list[str] = [
    f"Repeat the following passage exactly, word for word:\n\n{_PASSAGES[0]}",
    f"Copy this Python function exactly as it is, then stop:\n\n{_PASSAGES[1]}",
    f"Rewrite the following text, keeping every sentence but replacing 'green plants' with 'plants':\n\n"
    f"{_PASSAGES[2]}",
    f"Repeat this letter exactly, word for word:\n\n{_PASSAGES[3]}",
    f"Correct the spelling mistakes in this text and write it out again in full:\n\n{_TYPOS}",
    f"Write out this list again, exactly as given:\n\n{_LIST}",
    f"Rename the function in this code to rolling_mean and write the whole code again:\n\n{_PASSAGES[1]}",
    f"Copy the following paragraph word for word, then stop:\n\n{_PASSAGES[0]}",
]
