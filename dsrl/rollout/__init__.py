"""Rollouts: the schedules (`rollouts.py` synchronous and colocated, `manager.py` asynchronous), the episodes
every sample is played as (`episode.py`), and the environments and tools of agents (`agents.py`)."""
