"""The pipeline engine with its loss outside (an nn.Sequential pipelined as a module of a larger model, the loss
after it), the one profiler on an nn.Sequential, and PlacementPlan (in-process, no process group)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

from bench.allocator import retain_freed_memory
from lightning_mgpu._compat.torch import PUBLIC_BATCHNORM_TYPES, is_batchnorm
from lightning_mgpu.placement import LayerCost, PlacementPlan, plan_stages, profile_layers
from lightning_mgpu.placement.planning.schedule import BACKWARD, FORWARD, Action, fill_drain, phase
from lightning_mgpu.placement.running.engine import Pipeline
from lightning_mgpu.placement.running.worker import PipelineError, StageWorkers


def _pipeline(model: nn.Sequential, points: list[str], **options) -> Pipeline:
    return Pipeline(model, points, ["cpu"] * (len(points) + 1), **options)


def _model(seed: int = 0, depth: int = 6, width: int = 24) -> tuple[nn.Module, nn.Sequential, nn.Module]:
    torch.manual_seed(seed)
    embed = nn.Linear(5, width)
    body = nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth)))
    head = nn.Linear(width, 3)
    return embed, body, head


def _grads(*modules: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for m in modules for p in m.parameters()]


@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
@pytest.mark.parametrize("microbatches", [1, 3, 4, 40])
def test_pipelined_gradients_equal_the_full_batch_gradients(microbatches: int, checkpoint: str) -> None:
    x, y = torch.randn(20, 5), torch.randint(0, 3, (20,))
    reference = _model()
    loss_ref = nn.functional.cross_entropy(reference[2](reference[1](reference[0](x))), y)
    loss_ref.backward()

    embed, body, head = copy.deepcopy(_model())
    pipe = _pipeline(body, ["2", "5"], microbatches=microbatches, checkpoint=checkpoint)
    try:
        out = pipe.forward(body, embed(x))
        loss = nn.functional.cross_entropy(head(out), y)
        loss.backward()
        assert pipe.has_pending_backward
        assert all(p.grad is None for p in body.parameters()), "the stages' backward must wait for Pipeline.backward"
        pipe.backward()
    finally:
        pipe.close()
    assert not pipe.has_pending_backward
    torch.testing.assert_close(loss, loss_ref, rtol=0, atol=1e-6)
    for got, want in zip(_grads(embed, body, head), _grads(*reference)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert any(g.abs().max() > 1e-3 for g in _grads(body)), "gradients too small for the comparison to mean anything"


def test_each_parameter_accumulates_once_per_step_and_across_steps() -> None:
    _, body, _ = _model(depth=4)
    hits: dict[int, int] = {}
    for p in body.parameters():
        p.register_post_accumulate_grad_hook(lambda q: hits.__setitem__(id(q), hits.get(id(q), 0) + 1))
    pipe = _pipeline(body, ["2"], microbatches=4)
    reference = copy.deepcopy(body)
    x = torch.randn(16, 24)
    try:
        for _ in range(2):  # two backwards without zero_grad: gradients add up, as in gradient accumulation
            pipe.forward(body, x).square().sum().backward()
            pipe.backward()
            reference(x).square().sum().backward()
    finally:
        pipe.close()
    assert set(hits.values()) == {2}, "DDP's reducer needs exactly one accumulation per parameter per backward"
    for got, want in zip(body.parameters(), reference.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=0, atol=1e-4)


def test_stages_really_run_at_the_same_time_but_never_two_micro_batches_each() -> None:
    import threading
    import time

    active, overlap, busy = [0], [False], {0: 0, 1: 0}
    twice = [False]
    lock = threading.Lock()

    class Probe(nn.Module):
        def __init__(self, stage: int) -> None:
            super().__init__()
            self.stage = stage

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with lock:
                active[0] += 1
                busy[self.stage] += 1
                overlap[0] |= active[0] > 1
                twice[0] |= busy[self.stage] > 1
            time.sleep(0.02)
            with lock:
                active[0] -= 1
                busy[self.stage] -= 1
            return x + 1

    model = nn.Sequential(Probe(0), Probe(1))
    pipe = _pipeline(model, ["1"], microbatches=4)
    try:
        with torch.no_grad():
            out = pipe.forward(model, torch.zeros(8, 2))
    finally:
        pipe.close()
    assert torch.equal(out, torch.full((8, 2), 2.0))
    assert overlap[0], "stage 1 never ran while stage 0 was running: no pipelining"
    assert not twice[0], "a stage ran two micro-batches at once"


def test_a_failing_stage_is_named_and_nothing_hangs() -> None:
    class Boom(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.shape[0] == 3:
                raise RuntimeError("bad micro-batch")
            return x

    model = nn.Sequential(nn.Linear(4, 4), Boom(), nn.Linear(4, 4))
    pipe = _pipeline(model, ["1", "2"], microbatches=3)
    try:
        with pytest.raises(PipelineError, match=r"stage 1 on cpu failed in forward: RuntimeError: bad micro-batch"):
            pipe.forward(model, torch.randn(9, 4))
        assert pipe.forward(model, torch.randn(4, 4)).shape == (4, 4)  # micro-batches of 2, 1, 1: the workers survived
    finally:
        pipe.close()


def test_no_grad_forward_records_nothing_and_bad_inputs_are_refused() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    pipe = _pipeline(model, ["1"], microbatches=2)
    try:
        with torch.no_grad():
            pipe.forward(model, torch.randn(4, 3))
        assert not pipe.has_pending_backward
        with pytest.raises(TypeError, match="one tensor"):
            pipe.forward(model, [torch.randn(4, 3)])
        with pytest.raises(ValueError, match="batch dimension"):
            pipe.forward(model, torch.randn(0, 3))
    finally:
        pipe.close()
    for kwargs, match in (
        ({"microbatches": 0}, "microbatches must be an integer >= 1"),
        ({"checkpoint": "sometimes"}, "checkpoint must be one of"),
        ({"threads_per_stage": 0}, "threads_per_stage must be an integer >= 1"),
    ):
        with pytest.raises(ValueError, match=match):
            Pipeline(nn.Sequential(nn.Linear(3, 3)), [], ["cpu"], **kwargs)
    with pytest.raises(ValueError, match="one device per stage"):
        Pipeline(nn.Sequential(nn.Linear(3, 3)), [], ["cpu", "cpu"])


def test_profile_counts_bytes_exactly_and_leaves_the_model_untouched() -> None:
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(10, 20), nn.BatchNorm1d(20), nn.ReLU(), nn.Linear(20, 4))
    running_mean = seq[1].running_mean.clone()
    costs = profile_layers(seq, torch.randn(8, 10), repeats=2, warmup=1, optimizer_state_factor=2)
    assert [c.kind for c in costs] == ["Linear", "BatchNorm1d", "ReLU", "Linear"]
    assert [c.param_count for c in costs] == [220, 40, 0, 84]
    assert (
        costs[0].param_bytes == 220 * 4 and costs[0].grad_bytes == 220 * 4 and costs[0].optimizer_bytes == 2 * 220 * 4
    )
    assert [c.output_bytes for c in costs] == [8 * 20 * 4, 8 * 20 * 4, 8 * 20 * 4, 8 * 4 * 4]
    assert costs[0].activation_bytes == 8 * 10 * 4  # Linear saves its input (and its weight: not an activation)
    assert costs[3].activation_bytes == 8 * 20 * 4
    assert all(c.forward_ms > 0 and c.backward_ms >= 0 for c in costs)
    assert costs[2].memory_bytes == costs[2].activation_bytes  # ReLU: no parameters
    torch.testing.assert_close(seq[1].running_mean, running_mean, rtol=0, atol=0)
    assert all(p.grad is None for p in seq.parameters())
    assert LayerCost.from_dict(json.loads(json.dumps(costs[0].as_dict()))) == costs[0]


def test_profile_computes_the_first_input_gradient_only_when_the_sample_needs_one() -> None:
    """The first stage of a pipeline never computes its input's gradient (a batch of data needs none): its
    backward is profiled the same way, and a first layer writing its input in place leaves the sample alone."""

    class Probe(nn.Module):
        def __init__(self, in_place: bool = False) -> None:
            super().__init__()
            self.linear, self.in_place, self.seen = nn.Linear(4, 4), in_place, []

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if torch.is_grad_enabled():  # the timed runs (not the pass that makes the next layer's input)
                self.seen.append(x.requires_grad)
            return self.linear(x.mul_(2) if self.in_place and not x.requires_grad else x)

    for sample_needs_grad in (False, True):
        for lead in ([], [nn.Flatten()]):  # a layer without parameters lets no gradient in either
            seq = nn.Sequential(*lead, Probe(in_place=True), Probe())
            sample = torch.randn(3, 4).requires_grad_(sample_needs_grad)
            before = sample.detach().clone()
            profile_layers(seq, sample, repeats=2, warmup=1)
            assert set(seq[-2].seen) == {sample_needs_grad} and set(seq[-1].seen) == {True}
            torch.testing.assert_close(sample.detach(), before, rtol=0, atol=0)


def test_profile_refuses_what_it_cannot_measure() -> None:
    with pytest.raises(TypeError, match="needs an nn.Sequential"):
        profile_layers(nn.Linear(2, 2), torch.randn(1, 2))
    with pytest.raises(ValueError, match="empty"):
        profile_layers(nn.Sequential(), torch.randn(1, 2))

    class Pair(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x, x

    with pytest.raises(TypeError, match=r"layer 1 \(1: Pair\) returns tuple"):
        profile_layers(nn.Sequential(nn.Linear(2, 2), Pair()), torch.randn(3, 2), repeats=1, warmup=0)
    with pytest.raises(ValueError, match="repeats must be an integer >= 1"):
        profile_layers(nn.Sequential(nn.Linear(2, 2)), torch.randn(3, 2), repeats=0)


def _costs(times: list[float], params: list[int]) -> list[LayerCost]:
    return [
        LayerCost(i, str(i), "Linear", t / 3, 2 * t / 3, p, 4 * p, 4 * p, 8 * p, 100, 64)
        for i, (t, p) in enumerate(zip(times, params))
    ]


def test_plan_balances_by_each_mode_and_reports_efficiency() -> None:
    layers = _costs([1, 1, 1, 1, 4], [100, 100, 100, 100, 1])
    by_time = plan_stages(layers, ["cuda:0", "cuda:1"], "time", microbatches=8)
    assert by_time.sizes == [4, 1] and by_time.stage_time_ms == pytest.approx([4, 4])
    assert by_time.balance_efficiency == pytest.approx(1.0)
    assert by_time.bubble_efficiency == pytest.approx(8 / 9)
    assert by_time.ideal_speedup == pytest.approx(2 * 8 / 9)
    by_params = plan_stages(layers, ["cuda:0", "cuda:1"], "params")
    assert by_params.sizes == [2, 3] and by_params.stage_params == [200, 201]
    assert by_params.bottleneck_stage == 1
    given = plan_stages(layers, ["a", "b"], [1, 4])
    assert given.sizes == [1, 4] and given.balance == [1, 4]
    text = str(by_time)
    assert "cuda:0" in text and "0-3" in text and "ideal efficiency" in text
    again = PlacementPlan.from_json(by_time.to_json())
    assert again.sizes == by_time.sizes and again.layers == by_time.layers
    assert again.as_dict() == by_time.as_dict()


def test_plan_errors_name_the_problem() -> None:
    layers = _costs([1, 2, 3], [1, 1, 1])
    with pytest.raises(ValueError, match="balance must be one of"):
        plan_stages(layers, ["a", "b"], "speed")
    with pytest.raises(ValueError, match=r"adds up to 4 layers but the split module has 3"):
        plan_stages(layers, ["a", "b"], [2, 2])
    with pytest.raises(ValueError, match="has 3 stage sizes but there are 2 devices"):
        plan_stages(layers, ["a", "b"], [1, 1, 1])
    with pytest.raises(ValueError, match="every stage size must be an integer >= 1"):
        plan_stages(layers, ["a", "b"], [3, 0])
    with pytest.raises(ValueError, match="cannot split 3 layers over 4 devices"):
        plan_stages(layers, ["a", "b", "c", "d"], "time")
    with pytest.raises(ValueError, match="microbatches must be an integer >= 1"):
        plan_stages(layers, ["a"], "time", microbatches=0)
    with pytest.raises(ValueError, match="memory"):  # every layer needs 116 bytes; 50 per device cannot hold one
        plan_stages(layers, ["a", "b"], "time", capacity=[50, 50])


def test_make_plan_is_a_deprecated_name_of_plan_stages() -> None:
    from lightning_mgpu.placement import make_plan

    layers = _costs([1, 1, 1, 1, 4], [100, 100, 100, 100, 1])
    with pytest.warns(DeprecationWarning, match="plan_stages"):
        old = make_plan(layers, ["a", "b"], "time", microbatches=2)
    assert old.as_dict() == plan_stages(layers, ["a", "b"], "time", microbatches=2).as_dict()


def test_retain_freed_memory_applies_on_glibc() -> None:
    import platform

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("glibc only")
    assert retain_freed_memory() is True


def test_batchnorm_check_sees_what_torch_keeps() -> None:
    """The private name behind ``_compat.torch``'s BatchNorm check still means what we read."""
    norms = [nn.BatchNorm1d(2), nn.BatchNorm2d(2), nn.BatchNorm3d(2), nn.SyncBatchNorm(2), nn.LazyBatchNorm1d()]
    assert all(is_batchnorm(m) for m in norms) and not any(is_batchnorm(m) for m in (nn.Linear(2, 2), nn.LayerNorm(2)))
    # The fallback for a torch without _BatchNorm classifies the same way.
    assert all(isinstance(m, PUBLIC_BATCHNORM_TYPES) for m in norms)
    assert not isinstance(nn.LayerNorm(2), PUBLIC_BATCHNORM_TYPES)


def test_fill_drain_is_each_stage_s_list_of_actions() -> None:
    import doctest

    from lightning_mgpu.placement.planning import schedule as schedule_module

    schedule = fill_drain(3, 4)
    assert len(schedule) == 3
    assert all([repr(a) for a in actions] == ["F0", "F1", "F2", "F3", "B3", "B2", "B1", "B0"] for actions in schedule)
    assert phase(schedule, FORWARD) == [[Action(FORWARD, i) for i in range(4)]] * 3
    assert phase(schedule, BACKWARD) == [[Action(BACKWARD, i) for i in (3, 2, 1, 0)]] * 3
    result = doctest.testmod(schedule_module)
    assert result.attempted >= 2 and result.failed == 0


def test_one_executor_runs_any_order_of_actions() -> None:
    """Values are addressed by (kind, micro-batch): a stage may take them in another order than they were sent."""
    seen: list[tuple[int, Action]] = []

    def program(j: int, actions: list[Action], receive, send) -> None:  # type: ignore[no-untyped-def]
        for action in actions:
            path = receive(action)
            seen.append((j, action))
            send(action, [*path, j])

    workers = StageWorkers([torch.device("cpu")] * 3, lambda value, device: value)
    try:
        f0, f1, b0 = Action(FORWARD, 0), Action(FORWARD, 1), Action(BACKWARD, 0)
        sink: list = [None, None]
        workers.run([[f0, f1], [f1, f0], [f0, f1]], program, [["in0"], ["in1"]], sink)
        assert sink == [["in0", 0, 1, 2], ["in1", 0, 1, 2]]
        assert [action for j, action in seen if j == 1] == [f1, f0]
        sink = [None]
        workers.run([[b0]] * 3, program, [["grad"]], sink)  # a backward flows from the last stage to the first
        assert sink == [["grad", 2, 1, 0]]
    finally:
        workers.close()


def test_in_place_layers_at_a_stage_start_and_on_the_output_work() -> None:
    torch.manual_seed(0)
    body = nn.Sequential(nn.Linear(6, 6), nn.ReLU(inplace=True), nn.Linear(6, 6))
    reference = copy.deepcopy(body)
    x = torch.randn(8, 6)
    pipe = _pipeline(body, ["1"], microbatches=2)
    try:
        out = pipe.forward(body, x)
        out.mul_(2)  # in place on the output
        out.sum().backward()
        pipe.backward()
    finally:
        pipe.close()
    (reference(x) * 2).sum().backward()
    for got, want in zip(body.parameters(), reference.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=0, atol=1e-6)


def test_a_gradient_shared_by_input_and_parameter_is_not_corrupted() -> None:
    class AddBias(nn.Module):  # autograd returns one tensor for both d/dx and d/dp
        def __init__(self) -> None:
            super().__init__()
            self.p = nn.Parameter(torch.randn(1, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.p

    torch.manual_seed(0)
    body = nn.Sequential(nn.Linear(4, 4), AddBias(), nn.Tanh())
    reference = copy.deepcopy(body)
    x = torch.randn(3, 4)
    pipe = _pipeline(body, ["1"], microbatches=3)
    try:
        pipe.forward(body, x).square().sum().backward()
        pipe.backward()
    finally:
        pipe.close()
    reference(x).square().sum().backward()
    for got, want in zip(body.parameters(), reference.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=0, atol=1e-6)


def test_a_second_output_waits_for_its_own_backward() -> None:
    torch.manual_seed(0)
    body = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    reference = copy.deepcopy(body)
    a, b = torch.randn(5, 4), torch.randn(5, 4)
    pipe = _pipeline(body, ["2"], microbatches=2)
    try:
        out_a, out_b = pipe.forward(body, a), pipe.forward(body, b)
        out_a.sum().backward()
        pipe.backward()  # only A's stages; B's output has no gradient yet
        assert pipe.has_pending_backward
        out_b.square().sum().backward()
        pipe.backward()
        assert not pipe.has_pending_backward
    finally:
        pipe.close()
    reference(a).sum().backward()
    reference(b).square().sum().backward()
    for got, want in zip(body.parameters(), reference.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=0, atol=1e-6)


def test_a_skip_connection_around_the_pipeline_gets_a_clear_error() -> None:
    embed, body = nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    pipe = _pipeline(body, ["1"])
    try:
        h = embed(torch.randn(2, 4))
        (pipe.forward(body, h) + h).sum().backward()
        with pytest.raises(RuntimeError, match="input is also used elsewhere in the loss"):
            pipe.backward()
    finally:
        pipe.close()


def test_recomputing_dropout_over_several_cpu_stages_is_refused() -> None:
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1)), nn.Linear(4, 4))
    with pytest.raises(ValueError, match="recomputed dropout masks would differ"):
        _pipeline(model, ["1"], checkpoint="except_last")
    _pipeline(model, ["1"], checkpoint="never").close()
    _pipeline(model, [], checkpoint="always").close()  # one stage: no interleaving
    _pipeline(nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.0)), ["1"], checkpoint="always").close()  # draws nothing


def _stage_grad_fns(pipe: Pipeline) -> set[str]:
    """Names of every backward node in the pending stages' graphs (from each stage's output: the last stage's result,
    the tensors the others handed over)."""
    names: set[str] = set()
    seen: set[int] = set()
    for record in pipe._pending:
        todo = [micro.result.grad_fn for micro in record.micros]
        todo += [edge.node for micro in record.micros for _, edge in micro.sources.values()]
        while todo:
            node = todo.pop()
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            names.add(node.name())
            todo.extend(fn for fn, _ in node.next_functions)
    return names


def _pipelined_vs_reference(build, x, *, microbatches=4, checkpoint="never", autocast=False):
    """Gradients of ``build()`` split in two CPU stages and pipelined, against the same model on the full batch."""
    torch.manual_seed(0)
    reference = build()
    model = copy.deepcopy(reference)
    context = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.enable_grad()
    with context:
        reference(x).float().square().mean().backward()
    pipe = _pipeline(model, [str(len(model) // 2)], microbatches=microbatches, checkpoint=checkpoint)
    try:
        with context:
            out = pipe.forward(model, x)
        names = _stage_grad_fns(pipe)
        out.float().square().mean().backward()
        pipe.backward()
    finally:
        pipe.close()
    got = {n: p.grad for n, p in model.named_parameters()}
    want = {n: p.grad for n, p in reference.named_parameters()}
    return got, want, names


@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_plain_linear_layers_accumulate_their_weight_gradient_in_place(checkpoint: str) -> None:
    def build() -> nn.Sequential:
        return nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 8, bias=False), nn.Sequential(nn.Linear(8, 4)))

    got, want, names = _pipelined_vs_reference(build, torch.randn(3, 10, 6), checkpoint=checkpoint)  # 3-D input
    if checkpoint == "never":
        assert "_LinearFunctionBackward" in names and "AddmmBackward0" not in names
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-5, msg=name)


def test_frozen_tied_or_hooked_linears_and_autocast_still_give_the_full_batch_gradients() -> None:
    class UsesWeight(nn.Module):  # uses the previous layer's weight outside nn.Linear (tied)
        def __init__(self, weight: nn.Parameter) -> None:
            super().__init__()
            self.weight = weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + 0.1 * (x @ self.weight.t())

    def build() -> nn.Sequential:
        tied = nn.Linear(8, 8)
        frozen_bias = nn.Linear(8, 8)
        frozen_bias.bias.requires_grad_(False)
        frozen = nn.Linear(8, 8)
        frozen.requires_grad_(False)
        hooked = nn.Linear(8, 8)
        hooked.register_forward_hook(lambda module, args, out: out * 2)
        return nn.Sequential(
            nn.Linear(5, 8), tied, UsesWeight(tied.weight), frozen_bias, frozen, hooked, nn.Linear(8, 3)
        )

    got, want, names = _pipelined_vs_reference(build, torch.randn(12, 5))
    assert "_LinearFunctionBackward" in names
    for name, grad in want.items():
        if grad is None:
            assert got[name] is None, name
        else:
            torch.testing.assert_close(got[name], grad, rtol=0, atol=1e-5, msg=name)

    # Under autocast the layers run as themselves (their bf16 matmuls), and the result still matches.
    got, want, names = _pipelined_vs_reference(build, torch.randn(12, 5), autocast=True)
    assert "_LinearFunctionBackward" not in names
    for name, grad in want.items():
        if grad is not None:
            torch.testing.assert_close(got[name], grad, rtol=0.05, atol=0.05, msg=name)


def test_copies_to_a_gpu_run_on_a_copy_stream_per_destination_that_the_consumer_waits_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The CUDA path of the hand-over, with torch.cuda's streams mocked (no GPU here): one copy stream per destination
    device, made once; the copy issued on it after it waited for the source's stream; the consumer's stream waits for
    it; both tensors recorded on the streams that use them. A copy to the CPU stays a plain ``.to``."""
    from lightning_mgpu.placement.running.handover import CopyStreams

    log: list[tuple[str, ...]] = []
    on_stream: list[str] = ["default"]

    class Stream:
        def __init__(self, name: str) -> None:
            self.name = name

        def wait_stream(self, other: Stream) -> None:
            log.append(("wait", self.name, other.name))

    class Tensor:  # what the hand-over reads of a tensor
        def __init__(self, device: str) -> None:
            self.device = torch.device(device)
            self.is_cuda = self.device.type == "cuda"

        def to(self, device: torch.device, non_blocking: bool = False) -> Tensor:
            log.append(("copy", str(device), on_stream[-1], str(non_blocking)))
            return Tensor(str(device))

        def record_stream(self, stream: Stream) -> None:
            log.append(("record", str(self.device), stream.name))

    class StreamContext:
        def __init__(self, stream: Stream) -> None:
            self.stream = stream

        def __enter__(self) -> None:
            on_stream.append(self.stream.name)

        def __exit__(self, *exc: object) -> None:
            on_stream.pop()

    made: list[str] = []

    def new_stream(device: torch.device) -> Stream:
        made.append(str(device))
        return Stream(f"copy@{device}")

    monkeypatch.setattr(torch.cuda, "Stream", new_stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: Stream(f"current@{device}"))
    monkeypatch.setattr(torch.cuda, "stream", StreamContext)
    monkeypatch.setattr(torch.cuda, "device", lambda device: StreamContext(Stream(on_stream[-1])))
    copies = CopyStreams()
    moved = copies.move(Tensor("cuda:0"), torch.device("cuda:1"))  # type: ignore[arg-type]
    assert moved.device == torch.device("cuda:1")
    assert log == [
        ("wait", "copy@cuda:1", "current@cuda:0"),  # the copy waits for what made the source
        ("copy", "cuda:1", "copy@cuda:1", "True"),  # issued on the copy stream, asynchronously
        ("wait", "current@cuda:1", "copy@cuda:1"),  # the consumer waits for the copy
        ("record", "cuda:0", "copy@cuda:1"),  # neither tensor's memory is reused too early
        ("record", "cuda:1", "current@cuda:1"),
    ]
    log.clear()
    copies.move(Tensor("cpu"), torch.device("cuda:1"))  # type: ignore[arg-type]  # host to device: nothing to wait for
    copies.move(Tensor("cuda:1"), torch.device("cuda:0"))  # type: ignore[arg-type]
    assert made == ["cuda:1", "cuda:0"]  # one stream per destination, made once
    assert ("copy", "cuda:1", "copy@cuda:1", "True") in log and ("copy", "cuda:0", "copy@cuda:0", "True") in log
    log.clear()
    copies.move(Tensor("cuda:0"), torch.device("cpu"))  # type: ignore[arg-type]
    assert log == [("copy", "cpu", "default", "False")]  # to the host: a plain, synchronous copy
