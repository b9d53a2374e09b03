"""The Python engine client against a live two-rank CPU cluster: outputs equal the semantic
computation from the checkpoint, rings equal gRPC, the asyncio group equals the sync one, and bad
input surfaces as typed errors on its rank (ABORTED on the other) with the group still serving."""
from __future__ import annotations

import asyncio
import subprocess
import tempfile
import time
import os
from pathlib import Path

import numpy as np
import pytest

from conftest import D, K, WORLD, random_step, rel_l2
from moe_runtime import GroupStepError, RankClient, RankGroup, StepInput, bf16_to_float32, errors
from moe_runtime.aio import AsyncRankGroup
from moe_runtime.tensors import float32_to_bf16, host_rows, routing_arrays

TOL = 1e-2


def check_outputs(cluster, layer, inputs, results):
    for r, (x, res) in enumerate(zip(inputs, results)):
        want = cluster.reference(layer, bf16_to_float32(x.hidden) if x.hidden.dtype == np.uint16 else x.hidden,
                                 x.topk_ids, x.topk_weights, x.admitted)
        got = bf16_to_float32(res.output) if res.output.dtype == np.uint16 else res.output.astype(np.float32)
        assert got.shape == want.shape, f"rank {r}"
        if want.size:
            assert rel_l2(got, want) <= TOL, f"rank {r}: rel L2 {rel_l2(got, want)}"


def test_group_steps_equal_the_semantic_computation(cluster):
    rng = np.random.default_rng(1)
    with RankGroup(cluster.targets, timeout=30) as group:
        for layer, tokens, decode, hot in [(0, (5, 3), False, False), (1, (0, 7), False, True), (0, (2, 2), True, False)]:
            inputs = [StepInput(*random_step(rng, t, hot=hot)) for t in tokens]
            results = group.step(layer, inputs, decode=decode)
            check_outputs(cluster, layer, inputs, results)
            for x, res in zip(inputs, results):
                assert res.output.dtype == np.uint16  # BF16 in, BF16 out, bits untouched on the client
                assert res.record.routes_attempted == len(x.hidden) * K
                assert res.record.routes_accepted == len(x.hidden) * K
                assert res.record.placement_generation >= 1
                assert res.record.layer == layer
                assert res.via == "grpc"


def test_float32_rows_and_dropped_routes(cluster):
    rng = np.random.default_rng(2)
    with RankGroup(cluster.targets, timeout=30) as group:
        inputs = []
        for t in (4, 6):
            h, ids, w = random_step(rng, t)
            admitted = rng.uniform(size=(t, K)) > 0.3
            inputs.append(StepInput(bf16_to_float32(h), ids, w, admitted))  # float32 on the wire
        results = group.step(0, inputs)
        for x, res in zip(inputs, results):
            assert res.output.dtype == np.float32
            assert res.record.routes_dropped == int((~x.admitted).sum())
        check_outputs(cluster, 0, inputs, results)


def steps_counted(cluster, rank: int) -> float:
    """The rank's moe_steps_total, summed over its series (its Prometheus endpoint)."""
    import urllib.request

    port = (cluster.work / f"{rank}.metrics").read_text().strip()
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("moe_steps_total{"))


def test_rings_answer_as_grpc_does(cluster):
    rng = np.random.default_rng(3)
    inputs = [StepInput(*random_step(rng, t)) for t in (6, 4)]
    with RankGroup(cluster.targets, timeout=30) as grpc_group:
        want = grpc_group.step(1, inputs)
    counted = [steps_counted(cluster, r) for r in range(WORLD)]
    with RankGroup(cluster.targets, timeout=30) as group:
        group.use_rings(max_tokens=16, d=D, k=K, spin_us=200)
        for _ in range(3):
            got = group.step(1, inputs)
            for g, w in zip(got, want):
                assert g.via == "ring"
                assert np.array_equal(g.output, w.output)
                # The slot's record reads as the gRPC response's, field for field.
                for f in ("placement_generation", "layer", "path", "fallback_reason", "routes_attempted",
                          "routes_accepted", "routes_dropped", "routes_remote", "routes_inter_node", "canary"):
                    assert getattr(g.record, f) == getattr(w.record, f), f
                assert g.record.routes_remote > 0
                assert set(g.record.stages_us) == set(w.record.stages_us)
                assert 0 < g.record.compute_latency_us <= g.record.server_latency_us
        # Ring steps are counted in the rank's metrics (once their answer is out).
        deadline = time.time() + 5
        while any(steps_counted(cluster, r) < counted[r] + 3 for r in range(WORLD)) and time.time() < deadline:
            time.sleep(0.02)
        assert [steps_counted(cluster, r) - counted[r] for r in range(WORLD)] == [3] * WORLD
        # A step larger than the rings' slots still goes through gRPC.
        big = [StepInput(*random_step(rng, t)) for t in (20, 1)]
        res = group.step(0, big)
        assert [r.via for r in res] == ["grpc", "ring"]
        check_outputs(cluster, 0, big, res)


def test_bad_input_is_a_typed_error_on_its_rank_and_aborts_the_other(cluster):
    rng = np.random.default_rng(4)
    with RankGroup(cluster.targets, timeout=30) as group:
        good = [StepInput(*random_step(rng, 3)) for _ in range(WORLD)]
        bad = list(good)
        ids = good[1].topk_ids.copy()
        ids[2, 1] = 99  # no such expert
        bad[1] = StepInput(good[1].hidden, ids, good[1].topk_weights)
        with pytest.raises(GroupStepError) as e:
            group.step(0, bad)
        assert isinstance(e.value.errors[1], errors.InvalidArgument)
        assert "topk_ids[2][1]" in str(e.value.errors[1])
        assert isinstance(e.value.errors[0], errors.Aborted)
        assert e.value.errors[0].retryable and not e.value.errors[1].retryable
        # A NaN row and a layer the model does not serve, the same way.
        nan = good[1].hidden.copy()
        nan[1, 5] = 0x7FC0
        bad[1] = StepInput(nan, good[1].topk_ids, good[1].topk_weights)
        with pytest.raises(GroupStepError) as e:
            group.step(0, bad)
        assert isinstance(e.value.errors[1], errors.InvalidArgument) and "hidden" in str(e.value.errors[1])
        with pytest.raises(GroupStepError) as e:
            group.step(7, good)
        assert all(isinstance(x, errors.InvalidArgument) for x in e.value.errors)
        assert "layer" in str(e.value.errors[0])
        # The group still serves.
        check_outputs(cluster, 1, good, group.step(1, good))
    # Malformed before it is sent: the client names the field.
    with RankClient(cluster.targets[0]) as c:
        h, ids, w = random_step(rng, 3)
        with pytest.raises(ValueError, match="topk_weights"):
            c.step(1, 0, h, ids, w[:2])
        with pytest.raises(TypeError, match="hidden"):
            c.step(1, 0, h.astype(np.int64), ids, w)


def test_a_bad_share_is_refused_before_any_rank_gets_the_step(cluster):
    """A share the client refuses (float ids on rank 1) raises before rank 0 is sent the step:
    rank 0 is not left waiting out its collective timeout, and the next step is served at once."""
    import time

    rng = np.random.default_rng(14)
    with RankGroup(cluster.targets, timeout=30) as group:
        good = [StepInput(*random_step(rng, 3)) for _ in range(WORLD)]
        bad = list(good)
        bad[1] = StepInput(good[1].hidden, good[1].topk_ids.astype(np.float32), good[1].topk_weights)
        start = time.monotonic()
        with pytest.raises(TypeError, match="topk_ids: integer dtype"):
            group.step(0, bad)
        # Sent to rank 0, the step would hold it for its 3 s collective timeout (--timeout_ms).
        assert time.monotonic() - start < 2.0, "rank 0 was sent the refused step and waited for rank 1"
        check_outputs(cluster, 0, good, group.step(0, good))


def test_steps_from_several_threads_take_turns(cluster):
    """Steps issued on one group from two threads reach every rank in one order: none aborts."""
    import concurrent.futures

    rng = np.random.default_rng(15)
    inputs = [[StepInput(*random_step(rng, 2)) for _ in range(WORLD)] for _ in range(2)]
    with RankGroup(cluster.targets, timeout=30, max_retries=0) as group:
        def run(i):
            for _ in range(40):
                check_outputs(cluster, 1, inputs[i], group.step(1, inputs[i]))
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            for f in [pool.submit(run, 0), pool.submit(run, 1)]:
                f.result()
        assert group.retried == 0


def test_a_ring_the_rank_closed_hands_steps_back_to_grpc(cluster):
    """When the rank closes a client's ring, the client drops it and the next steps go through
    gRPC, even with a step left outstanding in it (its answer never comes), instead of failing
    every step or spinning on the dead ring."""
    import concurrent.futures

    from moe_runtime._proto import expert_layer_pb2 as pb

    rng = np.random.default_rng(16)
    x0, x1 = random_step(rng, 3), random_step(rng, 2)
    with RankGroup(cluster.targets, timeout=30) as group:
        want = group.step(1, [StepInput(*x0), StepInput(*x1)])
    c0, c1 = RankClient(cluster.targets[0], rank=0), RankClient(cluster.targets[1], rank=1)
    try:
        c0.use_ring(max_tokens=8, d=D, k=K, spin_us=200)
        ring = c0._ring
        ring._n_submitted += 1  # a step left outstanding, as a submit racing the close leaves it
        ring._pending.append((None, 0.0))
        c0._stub.CloseStepRing(pb.CloseStepRingRequest(ring_id=ring.id), timeout=10)
        assert ring.closed
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            for step_id in (660001, 660002):
                other = pool.submit(c1.step, step_id, 1, *x1)
                got = c0.step(step_id, 1, *x0)
                other.result(timeout=20)
                assert got.via == "grpc" and np.array_equal(got.output, want[0].output)
        assert not c0.using_ring
    finally:
        c0.close()
        c1.close()


def test_bad_input_through_a_ring_is_a_typed_error_too(cluster):
    rng = np.random.default_rng(5)
    with RankGroup(cluster.targets, timeout=30) as group:
        group.use_rings(max_tokens=8, d=D, k=K, spin_us=200)
        good = [StepInput(*random_step(rng, 2)) for _ in range(WORLD)]
        ids = good[0].topk_ids.copy()
        ids[1, 0] = -1
        with pytest.raises(GroupStepError) as e:
            group.step(0, [StepInput(good[0].hidden, ids, good[0].topk_weights), good[1]])
        assert isinstance(e.value.errors[0], errors.InvalidArgument) and "topk_ids[1][0]" in str(e.value.errors[0])
        assert isinstance(e.value.errors[1], errors.Aborted)
        res = group.step(0, good)
        assert all(r.via == "ring" for r in res)
        check_outputs(cluster, 0, good, res)


def test_asyncio_group_equals_the_sync_group(cluster):
    rng = np.random.default_rng(6)
    inputs = [StepInput(*random_step(rng, t)) for t in (3, 5)]
    with RankGroup(cluster.targets, timeout=30) as group:
        want = group.step(1, inputs)

    async def run():
        g = AsyncRankGroup(cluster.targets, timeout=30)
        try:
            return await g.step(1, inputs)
        finally:
            await g.close()

    got = asyncio.run(run())
    for g, w in zip(got, want):
        assert np.array_equal(g.output, w.output)


def test_streams_serve_steps_in_order(cluster):
    rng = np.random.default_rng(7)
    with RankClient(cluster.targets[0], rank=0) as c0, RankGroup([cluster.targets[1]]) as _:
        c1 = RankClient(cluster.targets[1], rank=1)
        with c0.stream() as s:
            import concurrent.futures

            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                for step_id in (9001, 9002):
                    x0, x1 = random_step(rng, 3), random_step(rng, 2)
                    other = pool.submit(c1.step, step_id, 0, *x1)
                    r0 = s.step(step_id, 0, *x0)
                    r1 = other.result()
                    check_outputs(cluster, 0, [StepInput(*x0), StepInput(*x1)], [r0, r1])
        c1.close()


def test_a_stream_outlives_its_step_timeout_and_threads_take_turns(cluster):
    """The stream's timeout bounds each step, not the stream: a step after the stream has been open
    longer than it is served. Steps from two threads each get their own answer."""
    import concurrent.futures

    rng = np.random.default_rng(17)
    with RankClient(cluster.targets[0], rank=0) as c0, RankClient(cluster.targets[1], rank=1) as c1:
        with c0.stream(timeout=1.5) as s, concurrent.futures.ThreadPoolExecutor(4) as pool:
            x0, x1 = random_step(rng, 3), random_step(rng, 2)
            other = pool.submit(c1.step, 9301, 0, *x1)
            check_outputs(cluster, 0, [StepInput(*x0), StepInput(*x1)], [s.step(9301, 0, *x0), other.result()])
            time.sleep(2.0)  # longer than the timeout: a deadline on the call would have ended the stream
            a0, a1 = random_step(rng, 4), random_step(rng, 1)
            b0, b1 = random_step(rng, 2), random_step(rng, 3)
            # Rank 1 takes the steps in order; on rank 0 the second thread's step is issued while the
            # first one's is in flight on the same stream.
            peers = pool.submit(lambda: [c1.step(9302, 0, *a1), c1.step(9303, 0, *b1)])
            first = pool.submit(s.step, 9302, 0, *a0)
            time.sleep(0.2)
            second = pool.submit(s.step, 9303, 0, *b0)
            p1 = peers.result()
            check_outputs(cluster, 0, [StepInput(*a0), StepInput(*a1)], [first.result(), p1[0]])
            check_outputs(cluster, 0, [StepInput(*b0), StepInput(*b1)], [second.result(), p1[1]])


def test_a_stream_step_not_answered_in_time_ends_the_stream(cluster):
    rng = np.random.default_rng(18)
    with RankClient(cluster.targets[0], rank=0) as c0:
        with c0.stream(timeout=0.5) as s:
            start = time.monotonic()
            with pytest.raises(errors.DeadlineExceeded, match="424343"):
                s.step(424343, 0, *random_step(rng, 2))  # rank 1 never joins this step
            assert time.monotonic() - start < 2.5  # the client's 0.5 s, not the rank's 3 s timeout
            with pytest.raises(errors.Unavailable, match="open another stream"):
                s.step(424344, 0, *random_step(rng, 2))
    time.sleep(3.5)  # the rank's own timeout for the lone step, before the next tests' steps


def test_a_rank_left_alone_answers_within_the_deadline(cluster):
    rng = np.random.default_rng(8)
    with RankClient(cluster.targets[0], rank=0) as c:
        with pytest.raises((errors.DeadlineExceeded, errors.Unavailable)):
            c.step(424242, 0, *random_step(rng, 2), timeout=1.0)
    # Once the rank's own collective timeout (3 s) has passed, the group serves again.
    with RankGroup(cluster.targets, timeout=30) as group:
        for attempt in range(20):
            try:
                inputs = [StepInput(*random_step(rng, 2)) for _ in range(WORLD)]
                check_outputs(cluster, 0, inputs, group.step(0, inputs))
                break
            except GroupStepError:
                import time

                time.sleep(0.5)
        else:
            pytest.fail("the group did not serve again after a lone step timed out")


def test_generated_stubs_are_current(tmp_path):
    root = Path(__file__).resolve().parents[2]
    subprocess.run([str(root / "python/tools/gen_stubs.sh"), str(tmp_path)], check=True)
    for name in ("expert_layer_pb2.py", "expert_layer_pb2_grpc.py"):
        assert (tmp_path / name).read_text() == (root / "python/moe_runtime/_proto" / name).read_text(), (
            f"{name} is stale: run python/tools/gen_stubs.sh")


def test_rows_by_reference_in_a_shared_region(cluster):
    from moe_runtime.shm import SharedRegion
    import concurrent.futures

    rng = np.random.default_rng(9)
    x0, x1 = random_step(rng, 4), random_step(rng, 3)
    with RankGroup(cluster.targets, timeout=30) as group:
        want = group.step(0, [StepInput(*x0), StepInput(*x1)])
    c0, c1 = RankClient(cluster.targets[0], rank=0), RankClient(cluster.targets[1], rank=1)
    try:
        with SharedRegion(c0, 2 * 4 * D * 2) as region, concurrent.futures.ThreadPoolExecutor(1) as pool:
            region.array(0, (4, D))[:] = x0[0]
            other = pool.submit(c1.step, 777001, 0, *x1)
            got = region.step(777001, 0, hidden_offset=0, tokens=4, d=D, topk_ids=x0[1], topk_weights=x0[2],
                              output_offset=4 * D * 2)
            other.result()
            assert np.array_equal(got.output, want[0].output)
            assert np.array_equal(region.array(4 * D * 2, (4, D)), want[0].output)
        # The step's output view outlives the region's close (it unmapped the memory under it).
        assert np.array_equal(got.output, want[0].output)
        # The region is gone from the rank once closed: naming it is an error naming the field.
        with pytest.raises(errors.MoeError, match="region"):
            c0.unregister_region(region.name)
    finally:
        c0.close()
        c1.close()


class _RegionRecorder:
    """Stands in for a RankClient's region calls (the rank's side is tested above)."""

    def __init__(self, refuse: bool = False):
        self.calls: list = []
        self.refuse = refuse

    def register_region(self, name, nbytes):
        self.calls.append(("register", name, nbytes))
        if self.refuse:
            raise errors.ResourceExhausted("region: too many")

    def unregister_region(self, name):
        self.calls.append(("unregister", name))


def test_a_shared_region_closed_under_live_views_keeps_them_valid():
    from moe_runtime.shm import SharedRegion

    c = _RegionRecorder()
    region = SharedRegion(c, 4096)
    assert os.path.exists("/dev/shm" + region.name)
    view = region.array(1024, (8, 16))
    view[:] = 7
    tail = view[4:]
    del view
    region.close()
    assert c.calls == [("register", region.name, 4096), ("unregister", region.name)]
    assert not os.path.exists("/dev/shm" + region.name)
    assert region.closed
    assert int(tail.sum()) == 7 * 4 * 16  # still mapped while a view lives (close() unmapped it: a crash)
    tail[:] = 1
    region.close()  # idempotent: nothing more reaches the rank
    assert len(c.calls) == 2
    with pytest.raises(errors.FailedPrecondition, match="closed"):
        region.array(0, (1,))
    with pytest.raises(errors.FailedPrecondition, match="closed"):
        region.step(1, 0, hidden_offset=0, tokens=1, d=8, topk_ids=np.zeros((1, 1), np.int32),
                    topk_weights=np.ones((1, 1), np.float32), output_offset=0)
    small = SharedRegion(c, 64)
    for offset, shape in ((60, (4,)), (-2, (1,)), (0, (2, 17))):
        with pytest.raises(errors.InvalidArgument, match="offset"):
            small.array(offset, shape)
    assert small.array(62, (1,)).shape == (1,)
    small.close()
    with pytest.raises(errors.InvalidArgument, match="nbytes"):
        SharedRegion(c, 0)
    refused = _RegionRecorder(refuse=True)
    with pytest.raises(errors.ResourceExhausted):
        SharedRegion(refused, 64)
    name = refused.calls[0][1]
    assert not os.path.exists("/dev/shm" + name)  # a region the rank refused leaves no file


def test_a_shared_region_of_a_killed_engine_is_unlinked():
    """An engine killed (SIGKILL) without closing its region: multiprocessing's resource tracker
    unlinks the object after it, so the rank can reclaim the region's slot."""
    import signal
    import sys

    root = Path(__file__).resolve().parents[2]
    code = ("import os, sys, time\n"
            "from moe_runtime.shm import SharedRegion\n"
            "class C:\n"
            "    def register_region(self, n, b): pass\n"
            "    def unregister_region(self, n): pass\n"
            "r = SharedRegion(C(), 4096)\n"
            "print(r.name, flush=True)\n"
            "time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(root / "python")})
    name = proc.stdout.readline().strip()
    assert name.startswith("/moe-py-"), name
    assert os.path.exists("/dev/shm" + name)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    for _ in range(100):
        if not os.path.exists("/dev/shm" + name):
            break
        time.sleep(0.05)
    assert not os.path.exists("/dev/shm" + name), "the killed engine's region is still linked"


def test_the_package_installs_with_pip(tmp_path):
    import shutil
    import sys

    root = Path(__file__).resolve().parents[2]
    src = tmp_path / "src"
    shutil.copytree(root / "python", src, symlinks=False)
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "--target", str(target), str(src)], check=True)
    out = subprocess.run([sys.executable, "-c", "import moe_runtime, moe_runtime.ring, moe_runtime.aio; "
                          "print(moe_runtime.__file__, moe_runtime.__version__)"],
                         env={"PYTHONPATH": str(target), "PATH": os.environ.get("PATH", "")}, check=True,
                         capture_output=True, text=True, cwd=tmp_path).stdout
    assert out.startswith(str(target)), out
    assert (target / "moe_runtime/_proto/expert_layer_pb2_grpc.py").exists()


def test_a_rank_over_tcp_with_a_token_and_mutual_tls(cluster, tmp_path):
    """A one-rank group serving the engine API on TCP (--engine_token_file) with mutual TLS: the
    client with the token, its certificate and the CA is served; without TLS, or trusting another
    CA, it is Unavailable; with TLS but a wrong token, Unauthenticated."""
    from moe_runtime import TlsFiles

    root = Path(__file__).resolve().parents[2]
    for ca in ("ca1", "ca2"):
        subprocess.run([str(root / "tools/make_test_ca.sh"), str(tmp_path / ca)], check=True, stdout=subprocess.DEVNULL)
    (tmp_path / "token").write_text("engine-token-0123456789abcdef\n")
    (tmp_path / "rv").mkdir()
    ca1 = tmp_path / "ca1"
    proc = subprocess.Popen(
        [os.environ["RANKD"], "--rank", "0", "--world", "1", "--rendezvous_dir", str(tmp_path / "rv"),
         "--checkpoint", str(cluster.checkpoint), "--engine_socket", str(cluster.sockets / "tls.sock"),
         "--engine_token_file", str(tmp_path / "token"), "--listen", "127.0.0.1:0",
         "--port_file", str(tmp_path / "port"), "--metrics_port_file", str(tmp_path / "metrics"),
         "--tls_cert", str(ca1 / "node.pem"), "--tls_key", str(ca1 / "node.key"), "--tls_ca", str(ca1 / "ca.pem")],
        stdout=open(tmp_path / "rank.log", "w"), stderr=subprocess.STDOUT)
    try:
        import time

        for _ in range(300):
            if (tmp_path / "port").exists() and (tmp_path / "port").read_text():
                break
            assert proc.poll() is None, (tmp_path / "rank.log").read_text()
            time.sleep(0.05)
        target = f"127.0.0.1:{(tmp_path / 'port').read_text().strip()}"
        rng = np.random.default_rng(10)
        x = random_step(rng, 3)
        good = TlsFiles(str(ca1 / "operator.pem"), str(ca1 / "operator.key"), str(ca1 / "ca.pem"))
        with RankClient(target, token="engine-token-0123456789abcdef", tls=good, timeout=10) as c:
            res = c.step(5, 0, *x)
            check_outputs(cluster, 0, [StepInput(*x)], [res])
        # The groups, sync and asyncio, take the same TLS files.
        with RankGroup([target], token="engine-token-0123456789abcdef", tls=good, timeout=10) as g:
            check_outputs(cluster, 0, [StepInput(*x)], g.step(0, [StepInput(*x)]))

        async def one_async_step():
            ag = AsyncRankGroup([target], token="engine-token-0123456789abcdef", tls=good, timeout=10)
            try:
                return await ag.step(0, [StepInput(*x)])
            finally:
                await ag.close()

        check_outputs(cluster, 0, [StepInput(*x)], asyncio.run(one_async_step()))
        with RankClient(target, token="engine-token-0123456789abcdef", timeout=3) as c:
            with pytest.raises(errors.Unavailable):
                c.step(6, 0, *x)
        ca2 = tmp_path / "ca2"
        other = TlsFiles(str(ca2 / "operator.pem"), str(ca2 / "operator.key"), str(ca2 / "ca.pem"))
        with RankClient(target, token="engine-token-0123456789abcdef", tls=other, timeout=3) as c:
            with pytest.raises(errors.Unavailable):
                c.step(7, 0, *x)
        with RankClient(target, token="not-the-token-0000000000", tls=good, timeout=10) as c:
            with pytest.raises(errors.Unauthenticated):
                c.step(8, 0, *x)
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_ring_slots_written_in_place(cluster):
    """An engine that builds its rows and routing in the ring's slot (no copy at submit) gets the
    same output as through gRPC."""
    rng = np.random.default_rng(11)
    x0, x1 = random_step(rng, 5), random_step(rng, 2)
    with RankGroup(cluster.targets, timeout=30) as group:
        want = group.step(1, [StepInput(*x0), StepInput(*x1)])
    c0, c1 = RankClient(cluster.targets[0], rank=0), RankClient(cluster.targets[1], rank=1)
    import concurrent.futures

    try:
        with c0.open_ring(max_tokens=8, d=D, k=K, slots=1, spin_us=200) as ring, \
                concurrent.futures.ThreadPoolExecutor(1) as pool:
            for step_id in (880001, 880002):
                views = ring.next_slot(5)
                views["hidden"][:] = x0[0]
                views["topk_ids"][:] = x0[1]
                views["topk_weights"][:] = x0[2]
                other = pool.submit(c1.step, step_id, 1, *x1)
                ring.submit_in_place(step_id, 1, 5)
                got = ring.wait(timeout=30)
                other.result()
                assert got.via == "ring" and np.array_equal(got.output, want[0].output)
            # Without the copy: the slot's own output rows, overwritten by the slot's next step.
            views = ring.next_slot(5)
            views["hidden"][:] = x0[0]
            views["topk_ids"][:] = x0[1]
            views["topk_weights"][:] = x0[2]
            other = pool.submit(c1.step, 880003, 1, *x1)
            ring.submit_in_place(880003, 1, 5)
            view = ring.wait(timeout=30, copy=False).output
            other.result()
            assert view.dtype == np.uint16 and np.array_equal(view, want[0].output)
            views = ring.next_slot(5)
            views["hidden"][:] = 0  # zero rows give zero outputs
            views["topk_ids"][:] = x0[1]
            views["topk_weights"][:] = x0[2]
            other = pool.submit(c1.step, 880004, 1, *x1)
            ring.submit_in_place(880004, 1, 5)
            ring.wait(timeout=30)
            other.result()
            from moe_runtime.tensors import bf16_to_float32

            assert np.all(bf16_to_float32(view) == 0), "the view is the slot's: the next step's output replaced it"
            with pytest.raises(ValueError, match="tokens, k"):
                ring.next_slot(9)
    finally:
        c0.close()
        c1.close()


def test_a_ring_slot_answering_another_step_is_refused(cluster):
    """The client checks that the answer in a step's slot is that step's (the result's seq): one
    that names another step is a DATA_LOSS error, never handed out as this step's output."""
    import struct
    import time

    from moe_runtime import errors
    from moe_runtime.ring import OFF_COMPLETED, RESULT_OFFSET

    rng = np.random.default_rng(12)
    x0, x1 = random_step(rng, 3), random_step(rng, 2)
    c0, c1 = RankClient(cluster.targets[0], rank=0), RankClient(cluster.targets[1], rank=1)
    import concurrent.futures

    try:
        with c0.open_ring(max_tokens=8, d=D, k=K, slots=2, spin_us=200) as ring, \
                concurrent.futures.ThreadPoolExecutor(1) as pool:
            other = pool.submit(c1.step, 770001, 1, *x1)
            ring.submit(770001, 1, *x0)
            other.result()
            deadline = time.monotonic() + 30
            while struct.unpack_from("<I", ring._mm, OFF_COMPLETED)[0] < 1 and time.monotonic() < deadline:
                time.sleep(0.001)
            assert struct.unpack_from("<I", ring._mm, OFF_COMPLETED)[0] == 1, "the rank never answered"
            res = ring._slot(0) + RESULT_OFFSET
            assert struct.unpack_from("<I", ring._mm, res)[0] == 0  # step 0's own answer ...
            struct.pack_into("<I", ring._mm, res, 7)  # ... made to name step 7
            with pytest.raises(errors.DataLoss, match="answers step 7 where step 0 was awaited"):
                ring.wait(timeout=30)
    finally:
        c0.close()
        c1.close()


def test_a_ring_step_whose_wait_timed_out_never_answers_the_next(cluster):
    """A ring step whose wait timed out stays outstanding, its answer still to come: the client's
    next step takes and drops that answer first and returns its own output, and a ring's own
    step() refuses while a step is outstanding instead of returning the earlier step's answer."""
    import concurrent.futures

    rng = np.random.default_rng(12)
    xa0, xa1, xb0, xb1 = (random_step(rng, t) for t in (3, 2, 4, 2))
    with RankGroup(cluster.targets, timeout=30) as group:
        want_a = group.step(1, [StepInput(*xa0), StepInput(*xa1)])
        want_b = group.step(1, [StepInput(*xb0), StepInput(*xb1)])
    assert not np.array_equal(want_a[0].output[:3], want_b[0].output[:3])
    c0, c1 = RankClient(cluster.targets[0], rank=0), RankClient(cluster.targets[1], rank=1)
    try:
        c0.use_ring(max_tokens=8, d=D, k=K, spin_us=200)
        # Rank 1 has not got step 990001: rank 0 waits for it, the client's wait times out.
        with pytest.raises(errors.DeadlineExceeded):
            c0.step(990001, 1, *xa0, timeout=0.3)
        c1.step(990001, 1, *xa1)  # now rank 0 runs it too; its answer lands in the ring unread
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            other = pool.submit(c1.step, 990002, 1, *xb1)
            got = c0.step(990002, 1, *xb0)
            other.result()
        assert got.via == "ring" and np.array_equal(got.output, want_b[0].output)
        with c0.open_ring(max_tokens=8, d=D, k=K, slots=2, spin_us=200) as ring, \
                concurrent.futures.ThreadPoolExecutor(1) as pool:
            ring.submit(990003, 1, *xa0)
            with pytest.raises(errors.FailedPrecondition, match="outstanding"):
                ring.step(990004, 1, *xb0)
            other = pool.submit(c1.step, 990003, 1, *xa1)
            assert np.array_equal(ring.wait(timeout=30).output, want_a[0].output)
            other.result()
    finally:
        c0.close()
        c1.close()


def _stand_in_rank(target):
    """A gRPC server (not started) on `target` whose Execute echoes the rows: a rank's stand-in."""
    from concurrent import futures

    import grpc
    from moe_runtime._proto import expert_layer_pb2 as pb
    from moe_runtime._proto import expert_layer_pb2_grpc as pb_grpc

    class Rank(pb_grpc.ExpertLayerServiceServicer):
        def Execute(self, request, context):
            return pb.StepResponse(step_id=request.step_id, output=request.hidden)

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_ExpertLayerServiceServicer_to_server(Rank(), server)
    server.add_insecure_port(target)
    return server


def _waits_for_a_restarted_rank(target, step):
    """`step(step_id, hidden, ids, weights)` runs one step through the client under test: a step
    with nobody at `target` fails UNAVAILABLE at once; the next, with a stand-in rank starting
    300 ms later, must wait for it and get its answer."""
    import threading
    import time

    rng = np.random.default_rng(3)
    hidden, ids, weights = random_step(rng, 2)
    start = time.monotonic()
    with pytest.raises(errors.Unavailable):
        step(1, hidden, ids, weights)  # nobody there: fails at once
    assert time.monotonic() - start < 2
    server = _stand_in_rank(target)
    timer = threading.Timer(0.3, server.start)
    timer.start()
    try:
        start = time.monotonic()
        res = step(2, hidden, ids, weights)
        waited = time.monotonic() - start
    finally:
        timer.join()
        server.stop(0)
    assert waited >= 0.25, f"answered after {waited:.3f} s, before the rank was there"
    assert res.output.shape == hidden.shape


def test_after_an_unavailable_step_the_next_waits_for_the_rank_to_be_reachable(tmp_path):
    """A rank that restarts (a replacement on the same socket) gets the next step: after a step
    failed UNAVAILABLE the client waits for the channel to reconnect (at most a second) instead of
    failing the next step at once, which would leave the rank's peers waiting out their
    collective timeout for it."""
    target = f"unix:{tmp_path}/rank.sock"
    with RankClient(target, timeout=10) as client:
        _waits_for_a_restarted_rank(target, lambda sid, h, i, w: client.step(sid, 0, h, i, w))


def test_the_asyncio_client_also_waits_for_a_restarted_rank(tmp_path):
    """The same for moe_runtime.aio's AsyncRankClient, on its own event loop."""
    import asyncio

    from moe_runtime.aio import AsyncRankClient

    target = f"unix:{tmp_path}/rank.sock"
    loop = asyncio.new_event_loop()

    async def make():
        return AsyncRankClient(target, timeout=10)

    client = loop.run_until_complete(make())
    try:
        _waits_for_a_restarted_rank(
            target, lambda sid, h, i, w: loop.run_until_complete(client.step(sid, 0, h, i, w)))
    finally:
        loop.run_until_complete(client.close())
        loop.close()


def test_routing_and_rows_conversions_check_what_they_skip_copying():
    """int32 ids pass as they are; wider ids are range-checked, float ids refused; rows already
    contiguous in their wire dtype are not copied by host_rows."""
    ids = np.array([[1, 2], [3, 4]], dtype=np.int32)
    w = np.full((2, 2), 0.5, dtype=np.float32)
    got_ids, got_w, k = routing_arrays(ids, w, 2)
    assert k == 2 and got_ids is ids and got_w is w
    got_ids, _, _ = routing_arrays(ids.astype(np.int64), w, 2)
    assert got_ids.dtype == np.int32 and np.array_equal(got_ids, ids)
    with pytest.raises(ValueError, match="beyond int32"):
        routing_arrays(np.array([[1, 2**31]], dtype=np.int64), w[:1], 1)
    with pytest.raises(ValueError, match="beyond int32"):
        routing_arrays(np.array([[-(2**31) - 1, 0]], dtype=np.int64), w[:1], 1)
    with pytest.raises(TypeError, match="integer dtype"):
        routing_arrays(ids.astype(np.float32), w, 2)
    rows = float32_to_bf16(np.ones((3, D), dtype=np.float32))
    meta, arr = host_rows(rows)
    assert arr is rows and meta.rows == 3 and meta.cols == D and meta.data == b""
    _, arr = host_rows(rows[:, ::2])  # a strided view is made contiguous
    assert arr.flags["C_CONTIGUOUS"] and arr.shape == (3, D // 2)


def test_device_slot_layout_matches_the_rank():
    """ring.device_geometry is ring::ComputeDeviceGeometry (the same numbers as the C++
    DeviceGeometryTest): hidden, output, ids and weights 256-byte aligned in each slot."""
    from moe_runtime.ring import device_geometry

    g = device_geometry(5, 24, 3, 2)
    assert (g["hidden"], g["output"], g["ids"], g["weights"]) == (0, 256, 512, 768)
    assert (g["slot_bytes"], g["total_bytes"]) == (1024, 2048)

