"""Everything start-up loads (policies, planners, text models and what they import) is out of the
garbage collector's reach once the server is ready: a flood of short-lived connections triggers
full collections, and each must scan only what the connections hold, not the whole process."""

from __future__ import annotations

import gc

import pytest
from text_helpers import small_model

from chunkline.server.config import PolicyConfig, ServerConfig
from chunkline.server.core.loopthread import LoopThread
from chunkline.server.entrypoints.app import ChunklineServer
from chunkline.server.planner.config import PlannerConfig

pytestmark = pytest.mark.live  # it starts a server on loopback


def test_what_the_last_start_up_step_made_is_frozen() -> None:
    config = ServerConfig(policies=[PolicyConfig(ref="noop")], port=0, http_port=0, no_auth=True, ledger=None,
                          planners=[PlannerConfig(name="plan")],
                          text=[small_model("tiny")])
    loop = LoopThread()
    server = ChunklineServer(config)
    loop.run(server.start())
    try:
        assert server.ready
        made_late = [server.planner, server.text]  # the text class starts last
        assert all(gc.is_tracked(o) for o in made_late)
        collected = {id(o) for o in gc.get_objects()}  # the permanent (frozen) generation is not listed
        assert [type(o).__name__ for o in made_late if id(o) in collected] == []
    finally:
        loop.run(server.shutdown())
        loop.close()
