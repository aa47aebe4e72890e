"""The one-path token-budget scheduler and the dataclasses its stages exchange. Pure Python: no torch."""
