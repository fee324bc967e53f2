"""The hostile-client benchmark's placement of its parties on CPUs: the lists it takes, the two
placements it measures, and a process's every thread pinned (a real child process)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from chunkline.bench.hostile import Placement, cpu_list, pin, placements


def test_cpu_lists_read_as_taskset_writes_them() -> None:
    assert cpu_list("1") == {1}
    assert cpu_list("0,2") == {0, 2}
    assert cpu_list("0-2,5") == {0, 1, 2, 5}


def test_the_shared_placement_is_always_measured_and_the_separate_one_when_the_attacker_has_cpus() -> None:
    args = argparse.Namespace(attacker_cpus=None, server_cpus=None, bystander_cpus=None)
    assert placements(args) == [Placement("shared")]
    args = argparse.Namespace(attacker_cpus="1", server_cpus="0", bystander_cpus=None)
    shared, separate = placements(args)
    assert shared == Placement("shared")
    assert (separate.server, separate.bystander, separate.attacker) == ({0}, {0}, {1})  # the bystander with the server
    assert "attacker and fake upstream on 1" in separate.describe(frozenset({0, 1}))
    assert "server on CPUs 0,1" in shared.describe(frozenset({0, 1}))


def test_pinning_a_process_pins_every_thread_it_has() -> None:
    cpu = min(os.sched_getaffinity(0))
    code = "import threading, sys; threading.Thread(target=sys.stdin.read).start(); print('up', flush=True); sys.stdin.read()"
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "up\n"
        pin(child.pid, frozenset({cpu}))
        threads = os.listdir(f"/proc/{child.pid}/task")
        assert len(threads) == 2
        assert all(os.sched_getaffinity(int(tid)) == {cpu} for tid in threads)
    finally:
        child.kill()
        child.wait()


def test_a_control_runs_at_background_priority_and_says_it_is_under_way() -> None:
    proc = subprocess.Popen([sys.executable, "-m", "chunkline.bench.hostile", "--attack", "control-spin", "--child"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "under way"
        if sys.platform == "linux":
            assert os.sched_getscheduler(proc.pid) == os.SCHED_IDLE
    finally:
        proc.kill()
        proc.wait()
