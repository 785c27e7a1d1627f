"""Reasoning models' thinking, kept apart from their answers: how each family marks it
(syntax.py), the answer text split as it streams (splitter.py), and the budget and grammar
gate the engine applies while a model thinks (gate.py)."""
