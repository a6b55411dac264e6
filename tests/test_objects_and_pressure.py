"""The rest of the port on both interpreters: tensor objects, observers, saved-prefix listing,
memory pressure with a retention rule, and requests whose prefix has no identity."""

from __future__ import annotations

import mlx.core as mx
import pytest

from kvstate import KvCacheService, Request, SimObject, Source, retention
from kvstate.interpreters.simulator import SimDisk
from kvstate.models.mlx_adapter import spec_from_model
from kvstate.models.reference import build

MODEL, CONFIG = build("llama", seed=20)
SPEC = spec_from_model(MODEL, "llama")
RAM = SPEC.bytes_for(64)
DISK = SPEC.bytes_for(1024)


class Simulated:
    """The service on the simulator, and how to make prefixes and objects there."""

    name = "simulator"

    def __init__(self, tmp_path, **options):
        self.disk = SimDisk()
        self.options = options

    def service(self, **more):
        return KvCacheService.simulated(SPEC, ram_bytes=RAM, disk_bytes=DISK,
                                        interpreter_options={"disk": self.disk}, **self.options, **more)

    def prefill(self, service, caches, tokens):
        return service.interpreter.prefill(caches, tokens)

    def make_object(self, nbytes, seed):
        return SimObject(("encoder-output", seed), nbytes)

    def same_object(self, a, b):
        return a.payload == b.payload and a.nbytes == b.nbytes


class Real(Simulated):
    """The service on the MLX interpreter, with files under a temporary directory."""

    name = "mlx"

    def __init__(self, tmp_path, **options):
        self.directory = str(tmp_path)
        self.options = options

    def service(self, **more):
        return KvCacheService.for_mlx(MODEL, config=CONFIG, spec=SPEC, ram_bytes=RAM, disk_dir=self.directory,
                                      disk_bytes=DISK, **self.options, **more)

    def prefill(self, service, caches, tokens):
        if tokens:
            mx.eval(MODEL(mx.array([list(tokens)]), cache=caches))
        return caches

    def make_object(self, nbytes, seed):
        mx.random.seed(seed)
        return {"patches": mx.random.normal((nbytes // 4,))}

    def same_object(self, a, b):
        return set(a) == set(b) and all(mx.array_equal(a[k], b[k]).item() for k in a)


@pytest.fixture(params=[Simulated, Real], ids=["simulator", "mlx"])
def world(request, tmp_path):
    return request.param(tmp_path)


def serve(world, service, prompt, namespace="n", session=None, reuses=True):
    request = Request(prompt, 4, session_id=session, reuses_prefix=reuses)
    state = service.acquire(request, namespace)
    caches = world.prefill(service, state.caches, prompt[state.reused_tokens:])
    if service.keeps(request):
        service.publish(request, namespace, prompt, caches)
    service.release(request)
    return state


def test_objects_hit_miss_restore_and_share_the_ram_budget(world):
    service = world.service()
    image = world.make_object(SPEC.bytes_for(16), seed=1)
    assert service.objects.get("image-1") is None
    assert service.objects.put("image-1", image)
    hit = service.objects.get("image-1")
    assert hit.source is Source.RAM and world.same_object(hit.value, image)
    assert service.flush().durable  # the write-behind copy is durable: the object may now leave RAM
    serve(world, service, tuple(range(100, 160)))  # a 60-token prefix: the object must leave RAM for it
    assert service.report().entries == 1
    from_disk = service.objects.get("image-1")
    assert from_disk.source is Source.DISK and world.same_object(from_disk.value, image)
    report = service.report()
    assert (report.object_hits, report.object_misses, report.object_restores) == (2, 1, 1)
    assert service.close().durable
    restarted = world.service()
    assert world.same_object(restarted.objects.get("image-1").value, image)
    assert restarted.saved_prefixes() == [("n", tuple(range(100, 160)))]  # objects are not prefixes


def test_observers_see_every_kept_prefix_and_no_object(world):
    service = world.service()
    seen = []
    service.on_put(lambda tokens, namespace: seen.append((namespace, tokens)))
    serve(world, service, tuple(range(1, 11)), namespace="a")
    serve(world, service, tuple(range(1, 11)), namespace="a")  # kept already: not seen twice
    service.objects.put("x", world.make_object(64, seed=2))
    assert seen == [("a", tuple(range(1, 11)))]


def test_a_prefix_without_identity_takes_fresh_state_reuses_and_keeps_nothing(world):
    service = world.service()
    prompt = tuple(range(1, 21))
    serve(world, service, prompt)
    state = serve(world, service, prompt + (5,), reuses=False)
    assert state.reused_tokens == 0 and state.source is Source.FRESH
    assert service.report().kept == 1


def test_pressure_gives_unprotected_ram_back_first_and_spares_running_requests(world, tmp_path):
    held = {"over": None}
    world.options = {"retention": retention.short_prefixes(16), "write_behind": False}
    service = world.service(pressure=lambda nbytes: held["over"] is not None and nbytes > held["over"])
    system = tuple(range(1, 13))
    serve(world, service, system)  # 12 tokens: protected
    serve(world, service, tuple(range(200, 240)))  # 40 tokens: not
    running = Request(system + (50, 51), 4)
    assert service.admit(running)
    state = service.acquire(running, "n")
    held["over"] = SPEC.bytes_for(20)
    service.boundary()  # the unprotected entry is spilled, then its RAM copy goes
    service.flush()
    report = service.report()
    assert report.entries == 1 and report.demotions == 1
    assert service.peek_prefix_len(system + (9,), "n") == len(system)  # the protected one stayed
    assert service.peek_prefix_len(tuple(range(200, 240)) + (1,), "n") == 0
    assert report.live_requests == 1 and report.projected_bytes == SPEC.bytes_for(len(running.prompt) + 4)
    caches = world.prefill(service, state.caches, running.prompt[state.reused_tokens:])
    service.publish(running, "n", running.prompt, caches)  # the running request's state was never touched
    service.release(running)
    held["over"] = None
    assert serve(world, service, tuple(range(200, 240)) + (1,)).reused_tokens == 40  # spilled, not lost


def test_closing_a_session_keeps_its_state_and_ends_its_affinity(world):
    service = world.service()
    serve(world, service, tuple(range(1, 21)), session="s")
    serve(world, service, tuple(range(1, 21)) + (7,), session="s")
    assert (service.report().session_hits, service.report().session_misses) == (1, 0)
    service.close_session("s")
    state = serve(world, service, tuple(range(1, 21)) + (8,), session="s")
    assert state.reused_tokens == 20
    assert (service.report().session_hits, service.report().session_misses) == (1, 0)
