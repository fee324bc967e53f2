"""The fleet-contention benchmark's pieces: workload files, FleetVLA's metrics, the DES mode."""

from __future__ import annotations

import json
import math

import pytest

from chunkline.bench.fleet_contention import before_for, defaults_for, des, meets, no_refresh_for
from chunkline.bench.fleet_contention.des import Jitter, run_des
from chunkline.bench.fleet_contention.metrics import IndexedReplay, RobotRecord, fleet_metrics, percentile
from chunkline.bench.fleet_contention.workload import SHIPPED, chunk_rows, load_workload


def test_the_shipped_workloads_load_and_armory_is_the_published_one() -> None:
    for name in SHIPPED:
        assert load_workload(name).robots
    w = load_workload("armory-l40s")
    assert len(w.robots) == 10 and w.max_batch == 3 and w.duration_s == 10.0
    assert w.batch_latency_ms == [73, 109.8, 142.4, 177.5, 211.1] and w.latency_s(9) == pytest.approx(0.2111)
    assert sorted((r.horizon, r.weight) for r in w.robots) == [(6, 5.0)] + [(10, 1.0)] * 9
    assert all(r.control_hz == 20 and r.network_ms == 5.0 for r in w.robots)
    assert {r.weight for r in load_workload("armory-l40s-equal").robots} == {1.0}


def test_a_bad_workload_file_is_refused_by_field(tmp_path) -> None:
    bad = tmp_path / "w.json"
    bad.write_text(json.dumps({"name": "x", "batch_latency_ms": [1.0], "max_batch": 1, "duration_s": 1.0,
                               "robots": [{"name": "a", "control_hz": -1, "horizon": 5}]}))
    with pytest.raises(ValueError, match="control_hz"):
        load_workload(str(bad))


def test_metrics_follow_fleetvlas_definitions() -> None:
    a = RobotRecord(1.0, ticks=10, executed=5, requests=2, chunks=1, ages=[0.1, 0.2])
    b = RobotRecord(5.0, ticks=10, executed=10, requests=2, chunks=2, ages=[0.3])
    m = fleet_metrics([a, b], duration_s=2.0)
    assert m.useful_actions == 15 and m.starved == pytest.approx(0.25)
    assert m.fairness == pytest.approx((0.5 + 1.0) ** 2 / (2 * (0.25 + 1.0)))
    assert m.tiers == {1.0: 0.5, 5.0: 1.0} and m.requests_per_robot_s == 1.0 and m.rows_per_chunk == 5.0
    assert percentile([0.1, 0.2, 0.3], 0.95) == 0.3 and m.age_p95_s == 0.3
    assert math.isnan(m.queue_ms) and math.isnan(m.batch_mean) and math.isnan(m.round_trip_ms)


def test_the_round_trip_breakdown_reads_the_replies_timing() -> None:
    r = RobotRecord(1.0, ticks=10, executed=10)
    r.on_reply({"queue_ms": 30.0, "batch_wait_ms": 10.0, "infer_ms": 100.0, "batch_size": 3.0}, 0.2)
    r.on_reply({"queue_ms": 0.0, "infer_ms": 73.0, "batch_size": 1.0}, 0.1)
    r.on_reply(None, None)  # a reply without timing counts as a chunk only
    m = fleet_metrics([r], duration_s=1.0)
    assert r.chunks == 3 and m.queue_ms == pytest.approx(20.0) and m.batch_mean == pytest.approx(2.0)
    assert m.round_trip_ms == pytest.approx(150.0) and m.rows_per_chunk == pytest.approx(10 / 3)


def test_des_mode_reports_where_the_round_trip_goes() -> None:
    w = load_workload("armory-l40s-equal").model_copy(update={"duration_s": 3.0})
    m = fleet_metrics(run_des(w, defaults_for), w.duration_s)
    # Every round trip holds at least a batch of one and the network; none holds more than a
    # second of queueing (the broker's idle deadline) on top of the largest batch.
    assert w.latency_s(1) * 1000 < m.round_trip_ms < 1000 + w.latency_s(3) * 1000 + 50
    assert 1.0 <= m.batch_mean <= w.max_batch and 0.0 <= m.queue_ms < m.round_trip_ms


def test_des_mode_paces_a_saturated_fleet_where_the_old_broker_floods_it() -> None:
    w = load_workload("armory-l40s-equal").model_copy(update={"duration_s": 4.0})
    new = fleet_metrics(run_des(w, defaults_for), w.duration_s)
    old = fleet_metrics(run_des(w, before_for), w.duration_s)
    assert new.useful_actions > 5 * old.useful_actions and new.requests_per_robot_s < old.requests_per_robot_s / 2
    # Every row after the frozen lead rows runs (10 - 2 for nine robots, 6 - 2 for one), less start-up.
    lead = defaults_for(w.robots[0]).paced_lead_rows
    assert new.rows_per_chunk > (9 * (10 - lead) + (6 - lead)) / 10 - 0.5 and new.fairness > 0.95


def test_the_benchmarks_server_runs_the_strategy_asked_for_with_its_robots_weights(tmp_path) -> None:
    from chunkline.bench.fleet_contention.wallclock import server_files
    from chunkline.server.config import load_config
    from chunkline.server.core.tenants import load_registry
    from chunkline.server.robot.fleet import RobotPolicies

    w = load_workload("armory-l40s")
    args, key = server_files(w, "fleet", tmp_path)
    config = load_config(tmp_path / "server.toml")
    assert args == ["--config", str(tmp_path / "server.toml")] and key.startswith("ck_")
    (policy,) = config.policies
    assert policy.batch_strategy == "fleet" and policy.max_batch_size == 3
    # One row more than the longest horizon: a chunk's rows start at its observation's tick.
    assert policy.args["curve_ms"] == "73,109.8,142.4,177.5,211.1" and policy.args["horizon"] == 11
    registry = load_registry(config.tenants)  # type: ignore[arg-type]
    assert registry.file is not None
    assert RobotPolicies.from_file(registry.file).weight_for("fleet", None, 5.0) == 5.0


def test_des_mode_runs_either_server_strategy_on_the_same_cores() -> None:
    w = load_workload("armory-l40s").model_copy(update={"duration_s": 3.0})
    by = {s: fleet_metrics(run_des(w, defaults_for, strategy=s), w.duration_s) for s in ("admission", "fleet")}
    for m in by.values():
        assert m.useful_actions > 0 and 0.0 <= m.starved < 1.0
    # The same robots and requests, batched by two different choosers: not the same run.
    assert by["admission"].as_dict() != by["fleet"].as_dict()


def test_the_latency_curve_policy_reproduces_a_frozen_prefix_and_continues_from_it() -> None:
    import numpy as np

    from chunkline.bench.fleet_contention.policy import STEP, LatencyCurvePolicy, planned_rows
    from chunkline.policies.prefix import ActionPrefix, stack_prefixes

    slept: list[float] = []
    p = LatencyCurvePolicy([0.073, 0.1098], horizon=5, dt=0.05, sleep=slept.append, clock=lambda: 0.0)
    assert p.accepts_prefix
    state = np.array([[0.1, 0.2], [0.3, 0.4]], dtype=np.float32)
    frozen = ActionPrefix(np.array([[0.5, 0.6], [0.7, 0.8]], dtype=np.float32), t0=0.0, dt=0.05, delay_steps=2)
    out, _ = p.infer_batch_with_prefix({"state": state}, stack_prefixes([frozen, None], horizon=5, action_dim=2), None)
    assert slept == [0.1098] and out.shape == (2, 5, 2)
    np.testing.assert_allclose(out[0, :2], frozen.actions)  # the frozen rows as they were sent
    np.testing.assert_allclose(out[0, 2:], frozen.actions[1] + STEP * np.arange(1, 4)[:, None], atol=1e-6)
    np.testing.assert_allclose(out[1], state[1] + STEP * np.arange(1, 6)[:, None], atol=1e-6)  # no prefix: from the state
    np.testing.assert_allclose(planned_rows(np.zeros(2), 3), STEP * np.arange(1, 4)[:, None] * np.ones((1, 2)))


def test_the_latency_curve_policy_takes_the_curves_latency_its_own_work_included() -> None:
    import numpy as np

    from chunkline.bench.fleet_contention.policy import LatencyCurvePolicy

    ticks = iter([10.0, 10.004, 20.0, 20.2])  # 4 ms of planning; then planning past the latency
    slept: list[float] = []
    p = LatencyCurvePolicy([0.073, 0.1098], horizon=5, dt=0.05, sleep=slept.append, clock=lambda: next(ticks))
    p.infer_batch({"state": np.zeros((2, 2), dtype=np.float32)})
    assert slept == [pytest.approx(0.1058)]
    p.infer_batch({"state": np.zeros((1, 2), dtype=np.float32)})
    assert len(slept) == 1  # no sleep once the latency is spent


def test_a_reply_reaches_its_robot_at_its_arrival_time_not_when_a_late_timer_wakes() -> None:
    from chunkline.bench.fleet_contention.wallclock import Landed, ReplyInbox

    inbox = ReplyInbox()
    inbox.put(Landed(1.005, "first", 1, 0.8))
    inbox.put(Landed(1.007, "second", 2, 0.9))
    assert inbox.due(1.0049) == []
    # The tick at 1.0052 takes the first before it runs (its timer may wake a millisecond late).
    assert [r.reply for r in inbox.due(1.0052)] == ["first"]
    assert [r.reply for r in inbox.due(1.0071)] == ["second"] and inbox.due(2.0) == []


def test_fleetvlas_rows_follow_the_observations_tick_and_ours_start_at_it() -> None:
    robot = load_workload("armory-l40s").robots[0]
    assert chunk_rows(robot, "next-tick") == robot.horizon + 1 and chunk_rows(robot, "obs-tick") == robot.horizon
    with pytest.raises(ValueError, match="rows_from"):
        chunk_rows(robot, "whenever")


def test_the_indexed_replay_runs_fleetvlas_latest_indexed_execution() -> None:
    r = IndexedReplay()
    r.request(1, 0.0)  # before the first tick: rows 1.. run from index 0
    r.tick(0.05)
    r.chunk(1, 5)  # four rows after the observation's tick
    for k in range(2, 5):
        r.tick(0.05 * k)
    assert r.executed == 3 and r.next_index == 3 and r.ages == pytest.approx([0.1, 0.15, 0.2])
    r.request(2, 0.2)  # one row (index 3) left; it runs before the answer lands
    r.tick(0.25)
    r.tick(0.3)  # starved: a held tick runs no index
    r.chunk(2, 5)  # rows for indices 2..6 (FleetVLA's four from 3): 2 and 3 ran, 4..6 run
    for k in range(7, 10):
        r.tick(0.05 * k)
    assert r.executed == 7 and r.next_index == 7 and r.ages[-3:] == pytest.approx([0.15, 0.2, 0.25])
    r.chunk(99, 5)  # an answer to nothing asked changes nothing
    assert not r.buffered


def test_des_reports_fleetvlas_count_beside_what_the_brokers_ran() -> None:
    w = load_workload("armory-l40s-equal").model_copy(update={"duration_s": 3.0})
    on_time = Jitter(tick_mean_s=0.0, tick_floor_s=0.0)  # the conventions' counts, not the ticks' noise
    nxt = run_des(w, defaults_for, rows_from="next-tick", jitter=on_time)
    obs = run_des(w, defaults_for, rows_from="obs-tick", jitter=on_time)
    fleetvla, ran = fleet_metrics(nxt, w.duration_s, indexed=True), fleet_metrics(nxt, w.duration_s)
    assert fleetvla.useful_actions <= min(fleetvla.indexed, fleetvla.ran) and ran.useful_actions == ran.ran == fleetvla.ran
    strict = sum(min(r.executed, r.replay.executed) for r in nxt)
    assert fleetvla.useful_actions == strict
    # The broker runs what index execution runs from the same arrivals, give or take a row per chunk
    # answered from a hold (it may start at the observation's tick's row).
    assert abs(fleetvla.indexed - fleetvla.ran) <= sum(r.chunks for r in nxt) // 10
    # A chunk that reaches one tick further runs more rows.
    assert fleetvla.useful_actions > fleet_metrics(obs, w.duration_s).useful_actions


def test_des_timing_jitters_as_live_reproducibly_by_seed() -> None:
    w = load_workload("armory-l40s").model_copy(update={"duration_s": 2.0})

    def trips(jitter: Jitter) -> list[float]:
        return [t for r in run_des(w, defaults_for, jitter=jitter) for t in r.round_trips]

    exact = trips(Jitter(0.0, 0.0, 0.0, 0.0, 0.0, 0.0))
    assert trips(Jitter(seed=1)) == trips(Jitter(seed=1))  # a seed is one run
    assert trips(Jitter(seed=1)) != trips(Jitter(seed=2)) != exact
    assert trips(Jitter(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)) == exact
    with pytest.raises(ValueError):
        Jitter(send_mean_s=-0.001)
    with pytest.raises(ValueError):
        Jitter(tick_mean_s=-0.001)
    with pytest.raises(ValueError):
        run_des(w, defaults_for, reply_overhead_s=0.001, jitter=Jitter(reply_mean_s=0.002))


@pytest.mark.parametrize(("workload", "strategy"), [("armory-l40s-equal", "admission"), ("armory-l40s", "fleet")])
def test_des_mode_brokers_run_the_rows_fleetvlas_index_executor_credits(workload: str, strategy: str) -> None:
    # A chunk answering a held state resumes after its observation's tick, as index execution
    # does: each robot's broker and the replay of its requests and chunks stay row for row in step,
    # so the replay sees every paced request as far ahead of its plan's end as the broker asked it.
    w = load_workload(workload).model_copy(update={"duration_s": 4.0})
    for r in run_des(w, defaults_for, strategy=strategy):  # ticks jitter: the lead takes each row once
        assert r.executed == r.replay.executed > 0


def test_des_robots_tick_late_and_observe_at_the_late_tick() -> None:
    # A plan anchored at one late tick sits off the grid of the next ticks (as on the wall clock):
    # an action's age is then not a whole number of periods.
    w = load_workload("armory-l40s").model_copy(update={"duration_s": 2.0})
    period = w.robots[0].period

    def off_grid(jitter: Jitter) -> int:
        ages = [a for r in run_des(w, defaults_for, jitter=jitter) for a in r.ages]
        assert ages
        return sum(abs(a / period - round(a / period)) > 1e-6 for a in ages)

    assert off_grid(Jitter(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)) == 0
    assert off_grid(Jitter(tick_mean_s=0.001, tick_floor_s=0.0)) > 0


def test_an_age_target_is_met_within_a_ticks_lateness_not_a_tick_later() -> None:
    # 20 Hz robots: an age of 12 periods whose tick woke a millisecond later than its
    # observation's is at 0.60 s; one a period later (13) or 6 ms over is not.
    w = load_workload("armory-l40s-equal")
    assert meets("age_p95_s", "<=", 0.6012, 0.60, w) and meets("age_p95_s", "<=", 0.6000000000000005, 0.60, w)
    assert not meets("age_p95_s", "<=", 0.6493, 0.60, w) and not meets("age_p95_s", "<=", 0.606, 0.60, w)
    # other figures: float residue only
    assert meets("useful_actions", ">=", 1497.0, 1497.0, w) and not meets("useful_actions", ">=", 1496.9, 1497.0, w)
    assert not meets("starved", "<=", 0.2511, 0.251, w)


def test_the_targets_say_on_how_many_runs_each_held(capsys: pytest.CaptureFixture[str]) -> None:
    # Each run is its own seed: a median can pass on targets that hold on few of them.
    from chunkline.bench.fleet_contention import main

    assert main(["--mode", "des", "--runs", "3", "--workload", "armory-l40s", "--strategy", "fleet",
                 "--baseline", "none", "--rows-from", "next-tick"]) == 0
    out = capsys.readouterr().out
    runs = [json.loads(line.split(": ", 1)[1]) for line in out.splitlines() if line.startswith("run ")]
    w5 = [r["tiers"]["5.0"] >= 0.92 - 1e-9 for r in runs]
    useful = [r["useful_actions"] >= 1294 for r in runs]
    assert len(runs) == 3
    assert f">= 0.92 (held on {sum(w5)} of 3 runs)" in out and f">= 1294 (held on {sum(useful)} of 3 runs)" in out
    assert f"all targets held on {sum(a and b for a, b in zip(w5, useful, strict=True))} of 3 runs" in out


def test_the_fleet_strategy_weighing_ages_keeps_the_equal_fleets_p95_within_its_bound() -> None:
    # Armory's workload at equal weights: a ten-row chunk back a tick late runs its last row 13
    # periods old. Served first when about to, on most seeds the p95 stays at 12 (0.60 s); by
    # executed time alone it holds on few.
    from chunkline.server.robot.fleet import FleetConfig

    w = load_workload("armory-l40s-equal")

    def held(config: FleetConfig | None) -> int:
        # Without refreshing (the broker's own way to keep a waiting request's observation fresh).
        runs = [run_des(w, no_refresh_for, strategy="fleet", jitter=Jitter(seed=s), fleet_config=config) for s in range(6)]
        return sum(meets("age_p95_s", "<=", fleet_metrics(r, w.duration_s, indexed=True).age_p95_s, 0.60, w) for r in runs)

    weighed, unweighed = held(None), held(FleetConfig(age_bound_s=None))
    assert weighed >= 5 and weighed >= unweighed + 2


def test_the_des_reply_overhead_is_a_setting_of_the_des_only(capsys: pytest.CaptureFixture[str]) -> None:
    # A strategy's margin shows as the round trip grows: each reply pays the overhead asked for.
    from chunkline.bench.fleet_contention import main

    def round_trip(ms: str) -> float:
        assert main(["--mode", "des", "--runs", "1", "--duration", "3", "--strategy", "fleet", "--baseline", "no-refresh",
                     "--rows-from", "next-tick", "--reply-overhead-ms", ms]) == 0
        out = capsys.readouterr().out
        assert f"reply overhead {ms} ms" in out
        run = json.loads(next(line for line in out.splitlines() if line.startswith("run 1 no-refresh")).split(": ", 1)[1])
        return float(run["round_trip_ms"])

    assert round_trip("20") > round_trip("4") + 10
    with pytest.raises(SystemExit):
        main(["--reply-overhead-ms", "8"])
    assert "a DES setting" in capsys.readouterr().err


def test_refreshing_a_waiting_request_keeps_the_equal_fleets_old_rows_down_without_new_gpu_work() -> None:
    # Armory's workload at equal weights, DES: a request that waits in the queue is refreshed with
    # the current observation (the server's replace keeps its place). Fewer rows run 13 periods
    # old or more, on every seed; the refreshes are counted apart and ask for no more batches.
    w = load_workload("armory-l40s-equal")
    for seed in range(4):
        on, off = (run_des(w, f, strategy="fleet", jitter=Jitter(seed=seed)) for f in (defaults_for, no_refresh_for))
        old = [sum(a >= 12.5 * 0.05 for r in recs for a in r.ages) for recs in (on, off)]
        assert old[0] < old[1]
        m_on, m_off = (fleet_metrics(recs, w.duration_s, indexed=True) for recs in (on, off))
        assert m_on.refreshes_per_robot_s > 0 == m_off.refreshes_per_robot_s
        assert m_on.requests_per_robot_s <= m_off.requests_per_robot_s * 1.05
        assert sum(r.chunks for r in on) <= sum(r.requests for r in on)  # one chunk per request, refreshed or not


def test_a_refresh_sent_or_not_leaves_every_other_delay_drawn_as_it_was() -> None:
    # An A/B of refresh on one seed differs by what refreshes do, not by a reshuffled draw: each
    # robot's ticks jitter the same whether any robot sent refreshes (they draw from their own stream).
    w = load_workload("armory-l40s")
    lateness: dict[str, list[list[float]]] = {}

    class Recorded(des._Sim):
        def tick_lateness(self, i: int) -> float:
            t = super().tick_lateness(i)
            lateness.setdefault(side, [[] for _ in w.robots])[i].append(t)
            return t

    for side, config_for in (("on", defaults_for), ("off", no_refresh_for)):
        records = Recorded(w, config_for, des.SEND_COST_S, des.REPLY_OVERHEAD_S, "fleet", "next-tick", Jitter(seed=3)).run()
        assert (sum(r.refreshes for r in records) > 0) is (side == "on")
    for on, off in zip(lateness["on"], lateness["off"], strict=True):
        n = min(len(on), len(off))
        assert n > 100 and on[:n] == off[:n]


def test_a_robot_the_fleet_strategy_serves_promptly_does_not_refresh_while_the_queued_ones_do() -> None:
    # Armory's weighted workload, DES: the robot the fleet strategy serves alone and at once has
    # its replies queue under two periods; a replacement would only move its cycle off the one
    # the strategy plans around. It refreshes at most before its replies say so; the rest refresh.
    w = load_workload("armory-l40s")
    for seed in range(3):
        records = run_des(w, defaults_for, strategy="fleet", jitter=Jitter(seed=seed))
        prompt = [r for r in records if sorted(r.queued)[len(r.queued) // 2] < 2 * 0.05]
        assert len(prompt) == 1 and prompt[0].refreshes <= 1
        assert sum(r.refreshes for r in records) > 20
