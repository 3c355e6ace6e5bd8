"""Reference agents built on fastper (extra ``agents``: torch, gymnasium).

Importing this package imports nothing heavy: ``fastper.agents.dqn`` and
``fastper.agents.sac`` import torch when they are imported themselves, and
``fastper.agents.cliffwalk`` needs only numpy.
"""
