"""Training draft heads for a target (graft-train-eagle3): corpus.py builds the text, eagle3.py trains."""
