#!/usr/bin/env python3
"""A calibration text that covers digits and names (issue 34: a needle is made of them):
*Persuasion* with, after every 40th word, a sentence carrying a number of 3–6 digits and a name
from the novel, in varied phrasings (never the needle harness's "pass key" wording).

    scripts/calib-digits-text.py ~/.cache/veloq/austen/persuasion.txt > persuasion-digits.txt
"""
import random
import sys

NAMES = ["Anne", "Captain Wentworth", "Sir Walter", "Lady Russell", "Mr. Elliot", "Mary", "Louisa",
         "Henrietta", "Admiral Croft", "Mrs. Smith", "Captain Benwick", "Elizabeth", "Charles Musgrove"]
FORMS = [
    "{n} wrote the figure {x} in the margin.",
    "The account of {n} stood at {x} pounds.",
    "{n} lived at number {x}, and said so twice: {x}.",
    "It was {x} days before {n} heard of it.",
    "The ticket {n} kept was marked {x}.",
    "{n} counted {x} steps to the Cobb.",
]


def main():
    words = open(sys.argv[1], encoding="utf-8").read().split(" ")
    rng = random.Random(0)
    out = []
    for i, w in enumerate(words):
        out.append(w)
        if i % 40 == 39:
            x = str(rng.randrange(100, 1_000_000))
            out.append(rng.choice(FORMS).format(n=rng.choice(NAMES), x=x))
    sys.stdout.write(" ".join(out))


if __name__ == "__main__":
    main()
