"""Fleet scale-out on Ray: what the robot path pays for running on a Ray-managed replica.

On a local Ray, in one run: (1) round trip through the directory's replica against a standalone
server, A B A B (target p50 <= 1.1x); (2) time to open a session through the directory against a
direct handshake; (3) recovery: the replica serving a 10 Hz robot is killed, and the gap until
another replica answers and until the fleet is back to strength; (4) robots served by 1 and 2
replicas; (5) text time to first token directly against through Ray Serve's ingress (needs
``ray[serve]``)."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from websockets.sync.client import connect

from chunkline.bench.help_text import plain_help
from chunkline.client import AsyncClient
from chunkline.client.wire.codec import Encoder
from chunkline.client.wire.protocol import SUBPROTOCOL
from chunkline.server.core.loopthread import LoopThread

from .overhead import robot_request, round_trips
from .report import Column, ResultsDir, default_out, format_table
from .serverproc import ServerProcess
from .stats import percentiles

__all__ = ["main", "LocalFleet"]


class LocalFleet:
    """A fleet whose manager runs on a loop thread of this process, replicas as Ray actors."""

    def __init__(self, replicas: int, server_args: dict[str, Any], replica_cpus: float) -> None:
        from chunkline.server.cluster.config import FleetConfig
        from chunkline.server.cluster.launch import RayLauncher
        from chunkline.server.cluster.manager import FleetManager
        from chunkline.server.config import ServerConfig

        server = ServerConfig.model_validate({"no_auth": True, "port": 0, **server_args})
        self.config = FleetConfig(server=server, replicas=replicas, directory_port=0, ledger=None,
                                  replica_cpus=replica_cpus, poll_interval_s=0.25, replica_timeout_s=1.0)
        self.loop = LoopThread("chunkline-fleet", uvloop=False)
        self.manager = FleetManager(self.config, None, RayLauncher(replica_cpus, 0.0, None), None)
        self.uri = self.run(self.manager.start())

    def run(self, coro: Any, timeout: float = 300.0) -> Any:
        return self.loop.run(coro, timeout)

    def restored(self, lost: str) -> bool:
        """The lost replica is gone from the fleet and a replacement is ready."""
        async def check() -> bool:
            live = [n for n, r in self.manager.replicas.items() if r.ready and not r.draining]
            return lost not in self.manager.replicas and len(live) >= self.config.replicas
        return bool(self.run(check()))

    def replica_of(self, client_ws: Any) -> str | None:
        port = client_ws.remote_address[1]

        async def find() -> str | None:
            for name, rec in self.manager.replicas.items():
                if rec.uri and rec.uri.endswith(f":{port}"):
                    return name
            return None
        return self.run(find())

    def kill(self, name: str) -> None:
        self.run(self.manager.replicas[name].handle.kill())

    def close(self) -> None:
        self.run(self.manager.stop())
        self.loop.close()


def _open(uri: str) -> Any:
    ws = connect(uri, subprotocols=[SUBPROTOCOL], compression=None, max_size=None)  # type: ignore[list-item]
    ws.recv()  # hello
    return ws


def measure_round_trip(fleet_uri: str, direct_uri: str, n: int, blocks: int) -> dict[str, list[float]]:
    request = Encoder().encode({"type": "infer", "id": 1, "obs": robot_request(), "obs_time": 0.0, "deadline_ms": 1000.0})
    via, direct = _open(fleet_uri), _open(direct_uri)
    round_trips(via, request, 100)
    round_trips(direct, request, 100)
    samples: dict[str, list[float]] = {"ray replica": [], "standalone": []}
    per = max(1, n // blocks)
    for _ in range(blocks):
        samples["ray replica"] += round_trips(via, request, per)
        samples["standalone"] += round_trips(direct, request, per)
    via.close()
    direct.close()
    return samples


def measure_placement(fleet_uri: str, direct_uri: str, n: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"through directory": [], "direct": []}
    for _ in range(n):
        for label, uri in (("through directory", fleet_uri), ("direct", direct_uri)):
            t = time.perf_counter()
            ws = _open(uri)
            out[label].append(time.perf_counter() - t)
            ws.close()
    return out


async def _recovery(fleet: LocalFleet, rounds: int) -> list[dict[str, float]]:
    obs = robot_request()
    out = []
    for _ in range(rounds):
        client = await AsyncClient.connect(fleet.uri)
        await client.infer(obs)
        victim = await asyncio.to_thread(fleet.replica_of, client._ws)
        assert victim is not None
        killed = time.monotonic()
        await asyncio.to_thread(fleet.kill, victim)
        while True:  # a robot at 10 Hz: ask, and on failure hold the fallback until the next tick
            try:
                await client.infer(obs, deadline_ms=1000.0)
                if await asyncio.to_thread(fleet.replica_of, client._ws) != victim:
                    break  # answered by another replica (ray.kill returns before the actor is gone)
            except Exception:
                pass
            await asyncio.sleep(0.1)
        gap = time.monotonic() - killed
        while await asyncio.to_thread(fleet.restored, victim) is False:
            await asyncio.sleep(0.1)
        out.append({"robot_gap_s": gap, "fleet_restored_s": time.monotonic() - killed})
        await client.close()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="chunkline bench cluster", description=plain_help(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--round-trips", type=int, default=1000)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--placements", type=int, default=50)
    parser.add_argument("--recoveries", type=int, default=3)
    parser.add_argument("--robots", default="4,8,12,16,24,32", help="robot counts for the capacity step ('' skips it)")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per capacity step")
    parser.add_argument("--text-requests", type=int, default=100, help="TTFT samples per path for the Serve ingress (0 skips)")
    parser.add_argument("--num-cpus", type=int, default=None, help="CPUs of the local Ray (default: all)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    import ray

    ray.init(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False, configure_logging=False)
    out = ResultsDir(args.out or default_out("cluster"), "cluster")
    results: dict[str, Any] = {}
    try:
        fleet = LocalFleet(2, {"policies": [{"ref": "noop"}]}, replica_cpus=0.5)
        with ServerProcess(["--policy", "noop"]) as direct:
            rt = measure_round_trip(fleet.uri, direct.uri, args.round_trips, args.blocks)
            pl = measure_placement(fleet.uri, direct.uri, args.placements)
        rec = asyncio.run(_recovery(fleet, args.recoveries))
        fleet.close()
        rtp = {k: percentiles(v) for k, v in rt.items()}
        plp = {k: percentiles(v) for k, v in pl.items()}
        results["round_trip_s"] = rtp
        results["ratio_p50"] = rtp["ray replica"]["p50"] / rtp["standalone"]["p50"]
        results["ratio_p99"] = rtp["ray replica"]["p99"] / rtp["standalone"]["p99"]
        results["placement_s"] = plp
        results["recovery"] = rec
        rows = [(f"round trip: {k}", v) for k, v in rtp.items()] + [(f"session open: {k}", v) for k, v in plp.items()]
        print(format_table(rows, [Column("", lambda r: r[0], align="<"), Column("p50 ms", lambda r: r[1]["p50"] * 1e3, ".3f"),
                                  Column("p99 ms", lambda r: r[1]["p99"] * 1e3, ".3f")]))
        print(f"round trip ray replica / standalone: p50 {results['ratio_p50']:.3f}x, p99 {results['ratio_p99']:.3f}x "
              "(target p50 <= 1.1x)")
        print("recovery after a replica is killed: robot's gap " +
              ", ".join(f"{r['robot_gap_s']:.2f}" for r in rec) + " s; fleet back to strength " +
              ", ".join(f"{r['fleet_restored_s']:.2f}" for r in rec) + " s")
        results["recovery_gap_median_s"] = statistics.median(r["robot_gap_s"] for r in rec)
        if args.text_requests:
            results["text_ingress"] = _text_ingress(args.text_requests)
        if args.robots:
            results["capacity"] = _capacity(args, out)
        out.write("result", results)
    finally:
        ray.shutdown()
    print(f"results in {out.path}/")
    return 0


def _text_ingress(n: int) -> dict[str, Any] | None:
    try:
        import ray.serve  # noqa: F401

        from chunkline.server.cluster.text_ingress import serve_text_ingress
    except ImportError:
        print("text ingress: skipped (ray[serve] not installed)")
        return None
    from .text_bench import TextServer, gateway_overhead

    server = TextServer([{"name": "lm"}], "text").start()
    try:
        via = serve_text_ingress([f"http://127.0.0.1:{server.port}"], port=None)
        got = asyncio.run(gateway_overhead(server.base_url, via, "lm", n))
    finally:
        from ray import serve

        serve.shutdown()
        server.stop()
    print(f"text TTFT p50: direct {got['direct_p50_ms']:.2f} ms, through Ray Serve's ingress {got['gateway_p50_ms']:.2f} ms "
          f"(+{got['added_p50_ms']:.2f} ms; p99 {got['direct_p99_ms']:.2f} vs {got['gateway_p99_ms']:.2f} ms)")
    return got


def _capacity(args: argparse.Namespace, out: ResultsDir) -> dict[str, Any]:
    from .arrivals import ConstantArrivals, schedule
    from .fleet import served
    from .loadgen import LoadOptions, StepRunner
    from .records import summarize

    fleets = {f"{n} replica{'s' if n > 1 else ''}": LocalFleet(n, {"policies": [{"ref": "loadtest"}]}, replica_cpus=0.5)
              for n in (1, 2)}
    steps: list[dict[str, Any]] = []
    failing = dict.fromkeys(fleets, 0)
    try:
        with StepRunner(LoadOptions(deadline_ms=100.0)) as runner:
            for n in (int(x) for x in args.robots.split(",")):
                for label, fleet in fleets.items():
                    if failing[label] >= 2:
                        continue
                    arrivals = schedule(ConstantArrivals(n * 10.0), args.duration, n, deadline_ms=100.0)
                    try:
                        result = runner.run(fleet.uri, arrivals)
                    except Exception as exc:  # the directory refused sessions: the fleet has no room for them
                        print(f"  {label:>10}  robots {n:3d}  sessions refused: {exc}", file=sys.stderr)
                        steps.append({"label": label, "robots": n, "served": False, "refused_sessions": True,
                                      "goodput": 0.0, "latency": {"p99": float("nan")}})
                        failing[label] += 1
                        continue
                    step = summarize(result.records, duration=args.duration, label=label, rate=n * 10.0).as_dict()
                    step["robots"] = n
                    step["served"] = served(step, 100.0)
                    failing[label] = 0 if step["served"] else failing[label] + 1
                    steps.append(step)
                    out.write("step", step)
                    print(f"  {label:>10}  robots {n:3d}  p99 {step['latency']['p99'] * 1000:7.1f} ms  "
                          f"good {step['good']}/{step['offered']}  {'served' if step['served'] else 'NOT served'}",
                          file=sys.stderr)
    finally:
        for f in fleets.values():
            f.close()
    best = {label: max([s["robots"] for s in steps if s["label"] == label and s["served"]], default=0) for label in fleets}
    print(format_table(steps, [Column("fleet", lambda s: s["label"], align="<"), Column("robots", lambda s: s["robots"]),
                               Column("goodput/s", lambda s: s["goodput"], ".0f"),
                               Column("p99 ms", lambda s: s["latency"]["p99"] * 1000, ".1f"),
                               Column("served", lambda s: "yes" if s["served"] else "no", align="<")],
                       title="capacity: 10 Hz robots, deadline 100 ms"))
    print("robots served: " + ", ".join(f"{k} {v}" for k, v in best.items()))
    return {"served": best, "steps": steps}


if __name__ == "__main__":
    sys.exit(main())
