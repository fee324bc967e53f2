"""Closed-loop evaluation: simulated robots on MuJoCo tasks driven by a remote policy through
three chunk-consuming strategies (openpi's synchronous loop, LeRobot's index-based async queue,
chunkline's broker), in a discrete-event mode and a real-time mode over a fault proxy.

Needs ``gymnasium[mujoco]`` (``pip install 'chunkline[sim]'``). Modules: :mod:`.tasks` (the
robots), :mod:`.strategies`, :mod:`.metrics`, :mod:`.des`, :mod:`.realtime`, :mod:`.suite`
(``chunkline bench closed-loop``), :mod:`.plots`, :mod:`.train_bc`, :mod:`.demo`.
"""

__all__: list[str] = []
